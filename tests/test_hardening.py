"""No request can hurt another (in-process checks): every value that sizes memory or time is
bounded before queueing, text the tokenizers cannot take is refused, bodies no request needs
are refused cheaply with bounded messages, and what still fails inside a batch fails alone."""

from __future__ import annotations

import dataclasses

import pytest

from deployments.http import CrossSiteGuard, api_key_sets, form_to_body, load_api_keys, parse_json
from pipeline.cache_dit_actions import preset_step_counts
from pipeline.contract.images import validate_image_request
from pipeline.contract.limits import ServingLimits
from pipeline.contract.videos import validate_video_request
from pipeline.errors import InvalidRequestError
from pipeline.modes import DualMode, GuidanceMode
from pipeline.runner import BatchRunner
from pipeline.sampling import resolve
from tests.helpers import batch_of, flux_params

SPECIAL = ("</s>", "<pad>", "<unk>", "<|endoftext|>", "<|startoftext|>")
LIMITS = ServingLimits("tiny-flux", 8, 64, 64, 16, 3.5, max_pixels=65536, max_steps=100, num_blocks=10,
                       special_tokens=SPECIAL, scm_preset_steps=preset_step_counts(100), max_timeout_s=600)
VIDEO = dataclasses.replace(LIMITS, model_name="tiny-wan", spatial_factor=16, guidance_embeds=False,
                            guidance_style=GuidanceMode.CFG, dual_mode=DualMode.BOUNDARY, temporal_factor=4,
                            default_num_frames=9, max_frames=33, default_boundary_ratio=0.875)


def refused(body: dict, limits: ServingLimits = LIMITS, video: bool = False) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        (validate_video_request if video else validate_image_request)(body, limits)
    return info.value


# -- 1. values that size memory or time ---------------------------------------------------------
@pytest.mark.parametrize("fields, param, words", [
    ({"enable_cache_dit": True, "num_inference_steps": 1, "cache_dit_params": {"max_warmup_steps": 2147483648}},
     "cache_dit_params", "max_warmup_steps"),  # the example that took the app down
    ({"cache_dit_params": {"max_warmup_steps": 17}}, "cache_dit_params", "at most num_inference_steps (16)"),
    ({"cache_dit_params": {"max_continuous_cached_steps": 2**40}}, "cache_dit_params", "max_continuous_cached_steps"),
    ({"num_inference_steps": 8, "cache_dit_params": {"scm_compute_bins": [1] * 9, "scm_cache_bins": [1]}},
     "cache_dit_params", "has 9 bins"),
    ({"cache_dit_params": {"taylorseer_order": 9}}, "cache_dit_params", "taylorseer_order"),
    ({"cache_dit_params": {"residual_diff_threshold": 1e300}}, "cache_dit_params", "residual_diff_threshold"),
    ({"cache_dit_params": {"Fn_compute_blocks": 2**70}}, "cache_dit_params", "Fn_compute_blocks"),
    ({"cache_dit_params": {"secondary": {"max_warmup_steps": 10**9}}}, "cache_dit_params", "secondary"),
    ({"guidance_scale": 3.5e38}, "guidance_scale", "at most 100"),
    ({"true_cfg_scale": 1e39}, "true_cfg_scale", "at most 100"),
    ({"timeout_s": 1e308}, "timeout_s", "at most 600"),
    # a value just past a bound is shown as sent, not rounded onto the bound (helper-50: "got 3600")
    ({"timeout_s": 600.0001}, "timeout_s", "at most 600 seconds, got 600.0001"),
    ({"guidance_scale": 100.0000001}, "guidance_scale", "at most 100, got 100.0000001"),
    ({"timeout_s": 600.0000000000001}, "timeout_s", "got 600.0000000000001"),  # 17 digits (helper-52)
    ({"seed": 2**64}, "seed", "less than"),
    ({"n": 2**64}, "n", "between 1 and 4"),
    ({"num_inference_steps": 2**63}, "num_inference_steps", "between 1 and 100"),
    ({"size": "99992x99992"}, "size", "at most 65536"),
    ({"n": True}, "n", "integer"),                 # strict: a bool is not a count
    ({"num_inference_steps": "8"}, "num_inference_steps", "integer"),
    ({"user": "u" * 300}, "user", "at most 256"),
])
def test_every_sizing_value_is_bounded_before_queueing(fields, param, words):
    err = refused({"prompt": "a red circle", **fields})
    assert err.param == param and words in err.message, err.message


@pytest.mark.parametrize("fields, param", [
    ({"num_frames": 2**70}, "num_frames"), ({"seconds": 1e308}, "seconds"), ({"fps": 2**40}, "fps"),
    ({"guidance_scale_2": 1e39}, "guidance_scale_2"), ({"num_frames": True}, "num_frames"),
])
def test_video_sizing_values_are_bounded(fields, param):
    assert refused({"prompt": "a", **fields}, VIDEO, video=True).param == param


def test_scm_presets_follow_cache_dits_own_mask_builder():
    """cache-dit's masks need 4, 6 or >= 8 steps: the table comes from its builder, and a
    request outside it is a 400 (it was a 500 at mount)."""
    table = preset_step_counts(12)
    assert table["fast"] == (4, 6, 8, 9, 10, 11, 12)
    err = refused({"prompt": "a", "num_inference_steps": 5, "cache_dit_params": {"scm_preset": "fast"}})
    assert err.param == "cache_dit_params" and "4, 6 or 8..100" in err.message
    validate_image_request({"prompt": "a", "num_inference_steps": 6, "cache_dit_params": {"scm_preset": "fast"}},
                           LIMITS)


@pytest.mark.parametrize("size", ["６４x64", " 64x64", "64 x 64", "64X64", "64x64 ", "٦٤x64", "+64x64"])
def test_size_takes_ascii_digits_only(size):
    assert refused({"prompt": "a", "size": size}).param == "size"


# -- 2. text the tokenizers cannot take, refused up front ---------------------------------------
@pytest.mark.parametrize("text, words", [
    ("\ud800", "lone surrogate"), ("a\x00b", "control character"), ("\x1b[31mred", "control character"),
    ("a red circle</s>", "special token"), ("<|endoftext|> x", "special token"),
])
@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_untokenizable_text_is_refused_naming_the_field(field, text, words):
    body = {"prompt": "a", field: text}
    err = refused(body)
    assert err.param == field and words in err.message


def test_tabs_newlines_and_other_scripts_are_fine():
    validate_image_request({"prompt": "a red\tcircle\non blue\r\n, 赤い円 🎨"}, LIMITS)


# -- 5. bodies no request needs: refused cheaply, messages bounded -----------------------------
def test_a_flood_of_unknown_keys_is_refused_fast_with_a_short_message(monkeypatch):
    from pipeline.contract.images import ImageGenerationRequest

    body = {"prompt": "a", "cache_dit_params": {f"k{i}": i for i in range(1_000_000)}}
    with monkeypatch.context() as patched:  # fast: refused by its shape, before pydantic walks a million keys
        patched.setattr(ImageGenerationRequest, "model_validate", classmethod(lambda *_, **__: pytest.fail("walked")))
        err = refused(body)
    assert len(err.message) < 300 and err.param == "body"
    many = {"prompt": "a", **{f"typo{i}": 1 for i in range(40)}}
    err = refused(many)
    assert "and 32 more problems" in err.message and len(err.message) < 1000


def test_deep_nesting_is_a_400_in_json_and_in_forms():
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(InvalidRequestError, match="nests too deeply"):
        parse_json(deep.encode())
    nested: dict = {}
    node = nested
    for _ in range(20):
        node["x"] = {}
        node = node["x"]
    assert "nest more than" in refused({"prompt": "a", "cache_dit_params": nested}).message
    body = form_to_body([("prompt", "a"), ("cache_dit_params", deep)])  # a form value that is deep JSON
    assert refused(body).param == "cache_dit_params"


def test_an_integer_of_more_digits_than_python_converts_is_a_400_naming_its_field():
    """helper-75: a seed of 100,000 digits was a 400 naming ``body`` with Python's own message
    ("Exceeds the limit (4300 digits) ... sys.set_int_max_str_digits()")."""
    huge = "9" * 100_000
    for raw, field in ((f'{{"prompt": "x", "seed": {huge}}}', "seed"),
                       (f'{{"prompt": "x", "lora": [{{"name": "a", "scale": -{huge}}}]}}', "lora"),
                       (f'[{huge}]', "body")):
        with pytest.raises(InvalidRequestError, match=f"^{field}: an integer of 100000 digits; no field takes") as err:
            parse_json(raw.encode())
        assert err.value.param == field and err.value.code == "invalid_value"
    assert parse_json(f'{{"seed": {"9" * 4300}}}'.encode())["seed"] == int("9" * 4300)  # a 400 naming seed later
    assert "seed" in refused({"prompt": "x", "seed": int("9" * 4300)}).message


def test_a_key_given_twice_in_a_json_object_is_a_400_naming_it():
    """``{"prompt": "x", "prompt": "y"}`` ran "y" without a word (a form field given twice is refused)."""
    with pytest.raises(InvalidRequestError, match="gives the key 'prompt' more than once") as err:
        parse_json(b'{"prompt": "x", "num_inference_steps": 2, "prompt": "y"}')
    assert err.value.param == "prompt" and err.value.code == "invalid_json"
    with pytest.raises(InvalidRequestError, match="gives the key 'scale' more than once in one object inside 'lora'"
                       ) as err:
        parse_json(b'{"prompt": "x", "lora": [{"name": "a", "scale": 1, "scale": 2}]}')  # at any depth
    assert err.value.param == "lora"  # the request field (helper-75: it named the inner key, "scale")
    with pytest.raises(InvalidRequestError) as err:
        parse_json(b'{"prompt": "x", "cache_dit_params": {"Fn_compute_blocks": 1, "Fn_compute_blocks": 2}, "n": 1}')
    assert err.value.param == "cache_dit_params"
    assert parse_json(b'{"a": {"k": 1}, "b": {"k": 2}}') == {"a": {"k": 1}, "b": {"k": 2}}  # one per object
    with pytest.raises(InvalidRequestError, match="form field 'lora' gives the key 'name' more than once") as err:
        form_to_body([("prompt", "a"), ("lora", '[{"name": "a", "name": "b"}]')])  # JSON text in a form field
    assert err.value.param == "lora"
    # JSON text with a mistake (helper-42: "lora: Input should be a valid list", nothing on why)
    for field, text in (("lora", '[{"name": "magenta"}'), ("cache_dit_params", ' {"Fn_compute_blocks": 1,}')):
        with pytest.raises(InvalidRequestError, match=f"form field '{field}' is not valid JSON .* at character") as err:
            form_to_body([("prompt", "a"), (field, text)])
        assert err.value.param == field and err.value.code == "invalid_json"
    assert form_to_body([("prompt", "a"), ("size", "64x64")])["size"] == "64x64"  # not JSON, not meant as JSON
    for body in ([1], "x", None):  # valid JSON, not an object: the envelope's code was null
        err = refused(body)
        assert err.param == "body" and err.code == "invalid_value" and "JSON object" in err.message


def sdk_form(call, files: tuple[str, ...], file_lists: tuple[str, ...] = ()) -> dict:
    """The body the Ingress decodes (Starlette's form parser, then ``form_to_body``) from the
    multipart form OpenAI's SDK sends for ``call(client)``: the SDK's own encoding, byte for byte."""
    import asyncio

    import httpx
    from openai import OpenAI
    from starlette.requests import Request

    from deployments.http import json_or_form_body
    from deployments.proxy import BODY_SCOPE_KEY

    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append((request.headers["content-type"], request.read()))
        return httpx.Response(200, json={"created": 0, "data": [], "id": "video_1", "status": "queued"})

    call(OpenAI(base_url="http://h/v1", api_key="k", max_retries=0,
                http_client=httpx.Client(transport=httpx.MockTransport(answer))))
    (content_type, raw), = sent
    scope = {"type": "http", "headers": [(b"content-type", content_type.encode())], BODY_SCOPE_KEY: raw}
    return asyncio.run(json_or_form_body(Request(scope), 1 << 20, 1 << 20, files=files, json=False,
                                         file_lists=file_lists))


def test_lists_of_objects_sent_by_the_sdk_as_form_fields_decode_to_the_body_sent():
    """The SDK writes ``lora[][name]`` per item, grouped by field (every name, then every scale)."""
    loras = [{"name": "magenta", "scale": 0.8}, {"name": "1", "scale": -0.5}]  # "1": a name stays text
    nested = {"Fn_compute_blocks": 2, "scm_cache_bins": [1, 2], "secondary": {"Bn_compute_blocks": 0}}
    body = sdk_form(lambda c: c.images.edit(image=("a.png", b"PNG"), prompt="123", extra_body={
        "lora": loras, "cache_dit_params": nested, "enable_cache_dit": True, "seed": 3}), ("image", "mask"), ("image",))
    assert body == {"image": b"PNG", "prompt": "123", "lora": loras, "cache_dit_params": nested,
                    "enable_cache_dit": True, "seed": 3}
    deep = [{"name": "a", "x": {"y": 1, "z": "t"}}, {"name": "b", "x": {"y": 2, "z": "u"}}]
    body = sdk_form(lambda c: c.videos.create(prompt="p", seconds="4", extra_body={"lora": [{"name": "a"}],
                                                                                     "deep": deep}),
                    ("input_reference",))
    assert body == {"prompt": "p", "seconds": "4", "lora": [{"name": "a"}], "deep": deep}
    interleaved = form_to_body([("lora[][name]", "a"), ("lora[][scale]", "1"), ("lora[][name]", "b"),
                                ("lora[][scale]", "2")])  # curl -F, item by item
    assert interleaved == {"lora": [{"name": "a", "scale": 1}, {"name": "b", "scale": 2}]}
    assert form_to_body([("lora", '[{"name": "a"}, {"name": "b", "scale": 2}]')])["lora"][1] == {"name": "b",
                                                                                                   "scale": 2}
    assert form_to_body([("image", b"a"), ("image", b"b"), ("mask", b"c"), ("x[]", "1"), ("x[]", "2")],
                        files=("image", "mask"), file_lists=("image",)) == {"image": [b"a", b"b"], "mask": b"c",
                                                                            "x": [1, 2]}  # lists


@pytest.mark.parametrize("items, param, words", [
    # items giving different fields: [{a}, {b, 0.5}] and [{a, 0.5}, {b}] are the same form
    ([("lora[][name]", "a"), ("lora[][name]", "b"), ("lora[][scale]", "0.5")], "lora", "same fields"),
    ([("x[][]", "1"), ("x[][]", "2")], "x", "a list inside a list"),
    ([("lora[][b][]", "1")], "lora", "a list inside a list"),
    # a list of values and a list of objects at once said "'lora[]' is given more than once"
    ([("lora[]", "a"), ("lora[][name]", "a")], "lora", r"given both as a list of objects \(lora\[\]\[name\]\)"),
    ([("lora", '[{"name": "a"}]'), ("lora[][name]", "b")], "lora", "send it one way"),
    ([("lora", "null"), ("lora[][name]", "b")], "lora", "given both as a list of objects"),  # was "more than once"
    # was silently one list of both (the other order: "given more than once")
    ([("lora", '[{"name": "a"}]'), ("lora[]", '{"name": "b"}')], "lora", "lora is given whole and item by item"),
    ([("lora[][b]", "1"), ("lora[][b][c]", "2")], "lora", "mixes a value and an object"),
    ([("prompt", "a"), ("prompt", "b")], "prompt", "given more than once"),
    ([("prompt", "a"), ("seed", "1"), ("seed", "1")], "seed", "given more than once"),
    ([("cache_dit_params[Fn_compute_blocks]", "1"), ("cache_dit_params[Fn_compute_blocks]", "2")],
     "cache_dit_params", "given more than once"),
    ([("cache_dit_params[x]", "1"), ("cache_dit_params", "2")], "cache_dit_params", "mixes"),
    ([("a]b", "1")], "a]b", "malformed"),
    # an upload field that takes one file (helper-25's review: "mask: Input should be a valid bytes")
    ([("image", b"a"), ("mask", b"m"), ("mask", b"m")], "mask", "given more than once; it takes one file"),
    ([("image", b"a"), ("mask[]", b"m")], "mask", "takes one file, sent as mask"),
    ([("image", b"a"), ("image", "c")], "image", "expected an uploaded file"),
    ([("image", b"a"), ("image[]", b"b")], "image", "mixes a value and a list"),
])
def test_forms_that_cannot_be_one_body_are_a_400_naming_the_field(items, param, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        form_to_body(items, files=("image", "mask"), file_lists=("image",))
    assert info.value.param == param
    assert info.value.code is not None  # some form errors carried code null


def test_long_values_are_not_echoed_whole():
    err = refused({"prompt": "a", "size": "x" * 5000, "attention_backend_override": "y" * 5000})
    assert len(err.message) < 600


def test_api_keys_come_from_an_env_var_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DITSERVE_TEST_KEYS", "k1, k2\nk3")
    (tmp_path / "keys").write_text("k4\n")
    assert load_api_keys("DITSERVE_TEST_KEYS", str(tmp_path / "keys")) == ("k1", "k2", "k3", "k4")
    # comments are not keys (helper-59: "Bearer API" authenticated with a "# API keys" header line)
    (tmp_path / "commented").write_text("\ufeff# ditserve API keys (one per line)\nsk-prod-1  # the web app\n\n"
                                        "#sk-old\nsk-abc#123\nsk-real,# old key sk-gone\n",  # a BOM, then a header
                                        encoding="utf-8")  # a '#' inside a key is the key's (helper-61: cut short)
    monkeypatch.setenv("DITSERVE_COMMENTED", "sk-a # first, sk-b\nsk-c,#sk-d")
    assert load_api_keys("DITSERVE_COMMENTED", str(tmp_path / "commented")) == ("sk-a", "sk-c", "sk-prod-1",
                                                                                  "sk-abc#123", "sk-real")
    for blank in (" ", ",", " ,\n, ", "# keys go here\n"):  # separators only served with auth off, saying nothing
        monkeypatch.setenv("DITSERVE_EMPTY", blank)
        with pytest.raises(ValueError, match=r"^auth.api_keys_env names DITSERVE_EMPTY, which is unset or holds no key "
                                             r"\(# comments aside\) in the Ingress replica's environment: Ray gives "
                                             "replicas the environment of their Ray node"):
            load_api_keys("DITSERVE_EMPTY")
        with pytest.raises(ValueError, match="^auth.batch_api_keys_env names DITSERVE_EMPTY, "):  # was api_keys_env
            load_api_keys("DITSERVE_EMPTY", field="batch_api_keys")
        (tmp_path / "blank").write_text(blank)
        with pytest.raises(ValueError, match="^auth.api_keys_file .* holds no key"):
            load_api_keys(None, str(tmp_path / "blank"))
        with pytest.raises(ValueError, match="^auth.batch_api_keys_file .* holds no key"):
            load_api_keys(None, str(tmp_path / "blank"), "batch_api_keys")
    with pytest.raises(ValueError, match="not a readable file"):
        load_api_keys(None, str(tmp_path / "missing"))


def test_a_key_in_both_sets_is_refused_and_short_keys_are_warned_about(monkeypatch, caplog):
    """A key in ``api_keys`` and ``batch_api_keys`` defaulted its requests to ``batch`` without a
    word; it is refused at the Ingress's start. Keys under 16 characters are accepted (a test
    setup's) with a warning."""
    long_key, other = "sk-" + "a" * 40, "sk-" + "b" * 40
    monkeypatch.setenv("DITSERVE_KEYS", f"{long_key}, short")
    monkeypatch.setenv("DITSERVE_BATCH_KEYS", f"{other}, {long_key}")
    with pytest.raises(ValueError, match=r"1 key\(s\) are both in auth.api_keys_\* and in auth.batch_api_keys_\*"):
        api_key_sets({"api_keys_env": "DITSERVE_KEYS", "batch_api_keys_env": "DITSERVE_BATCH_KEYS"})
    monkeypatch.setenv("DITSERVE_BATCH_KEYS", other)
    with caplog.at_level("WARNING", logger="ray.serve"):
        sets = api_key_sets({"api_keys_env": "DITSERVE_KEYS", "batch_api_keys_env": "DITSERVE_BATCH_KEYS"})
    assert sets == ((long_key, "short"), (other,))
    assert "1 API key(s) are shorter than 16 characters" in caplog.text
    caplog.clear()
    monkeypatch.setenv("DITSERVE_KEYS", long_key)
    with caplog.at_level("WARNING", logger="ray.serve"):
        assert api_key_sets({"api_keys_env": "DITSERVE_KEYS"}) == ((long_key,), ())
    assert "shorter" not in caplog.text


# -- 2. what still fails inside a batch fails alone ---------------------------------------------
@pytest.fixture(scope="module")
def runner():
    return BatchRunner("tiny-flux")


def test_a_poisoned_request_fails_alone_and_leaves_its_batch_unchanged(runner):
    """A lone surrogate past validation (the Ingress refuses it; here it is injected) makes the
    tokenizer raise inside the batch: only that request fails, the others' images are the
    ones they get without it."""
    good = [flux_params(f"a red circle {i}", i, steps=4, size=(64, 64)) for i in range(3)]
    poisoned = dataclasses.replace(good[0], prompt="\ud800", request_id="poison", seed=99)
    clean = runner.run(batch_of(*good))
    mixed = runner.run(batch_of(good[0], poisoned, good[1], good[2]))
    assert [o.request_id for o in mixed] == ["r0", "poison", "r1", "r2"]
    assert mixed[1].error is not None and mixed[1].error.param == "prompt" and not mixed[1].images
    assert "poison" in mixed[1].error.message and mixed[1].error.status_code == 400
    for alone, inside in zip(clean, [mixed[0], mixed[2], mixed[3]], strict=True):
        assert inside.error is None and inside.images == alone.images


def test_a_poisoned_negative_prompt_fails_alone(runner):
    guided = [flux_params(f"a blue square {i}", i, steps=4, size=(64, 64), negative="blurry", true_cfg_scale=3.0)
              for i in range(2)]
    poisoned = dataclasses.replace(guided[0], negative_prompt="\udfff", request_id="poison")
    clean = runner.run(batch_of(*guided))
    mixed = runner.run(batch_of(poisoned, *guided))
    assert mixed[0].error.param == "negative_prompt"
    assert [o.images for o in mixed[1:]] == [o.images for o in clean]
    only = runner.run(batch_of(poisoned))
    assert only[0].error is not None  # a batch of only poisoned requests answers each of them


def test_form_fields_decode_to_the_json_body():
    body = form_to_body([("prompt", "a"), ("num_inference_steps", "8"), ("cache_dit_params[scm_cache_bins][]", "2")])
    assert body == {"prompt": "a", "num_inference_steps": 8, "cache_dit_params": {"scm_cache_bins": [2]}}
    assert resolve(validate_image_request({"prompt": "a"}, LIMITS), LIMITS).num_inference_steps == 16


@pytest.mark.parametrize("variant", [None, 5, ["video"], "x" * 5000])
def test_a_handle_call_with_a_variant_that_is_not_one_is_a_400_naming_it(variant):
    """Through a handle ``video_content(id, variant=None)`` raised ``TypeError: 'NoneType' object
    is not subscriptable`` (the message cut the value as a string); a list was unhashable."""
    import asyncio

    from deployments.ingress import Ingress

    ingress = object.__new__(Ingress.func_or_class)  # the check comes before any Router call
    with pytest.raises(InvalidRequestError, match="variant must be one of video, thumbnail") as err:
        asyncio.run(ingress.video_content("video_1", variant))
    assert err.value.param == "variant" and len(err.value.message) < 200


def test_a_multipart_body_cut_short_is_refused_not_run_without_its_last_part():
    """Starlette's parser keeps a part once the next delimiter arrives and says nothing when the
    body ends first: a body cut in its last part (a mask, an input_reference, a strength) ran
    without it, an inpainting as image-to-image with 200 (helper-25's review). The SDK's own
    encoding, whole and cut at every point past its first part."""
    import asyncio

    from starlette.requests import Request

    from deployments.http import json_or_form_body
    from deployments.proxy import BODY_SCOPE_KEY

    boundary = "ditserve-test-boundary"
    parts = [("prompt", None, b"x"), ("image", "in.png", b"\x89PNG" + bytes(range(256))),
             ("mask", "mask.png", b"\x89PNG" + bytes(range(255, -1, -1))), ("strength", None, b"0.1")]
    raw = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"'.encode()
                   + (f'; filename="{file}"\r\nContent-Type: image/png'.encode() if file else b"")
                   + b"\r\n\r\n" + value + b"\r\n" for name, file, value in parts) + f"--{boundary}--\r\n".encode()

    def decoded(body: bytes) -> dict:
        scope = {"type": "http", "headers": [(b"content-type", f"multipart/form-data; boundary={boundary}".encode())],
                 BODY_SCOPE_KEY: body}
        return asyncio.run(json_or_form_body(Request(scope), 1 << 20, 1 << 20, files=("image", "mask"), json=False,
                                             file_lists=("image",)))

    whole = decoded(raw)
    assert set(whole) == {"prompt", "image", "mask", "strength"} and whole["strength"] == 0.1
    assert decoded(raw + b"an epilogue, which RFC 2046 allows")["mask"] == whole["mask"]
    first_part_end = raw.index(b"--" + boundary.encode(), 1)
    for cut in range(first_part_end, len(raw) - 3, 7):
        with pytest.raises(InvalidRequestError, match="ends without its closing boundary") as info:
            decoded(raw[:cut])
        assert (info.value.param, info.value.code) == ("body", "invalid_form"), cut
    # 17 uploads: Starlette's bound, named as the uploads' field (helper-63: param body)
    many = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="image[]"; filename="{i}.png"\r\n'
                    f"Content-Type: image/png\r\n\r\n".encode() + b"\x89PNG\r\n" for i in range(17))
    with pytest.raises(InvalidRequestError, match="image and mask: more than 16 files in one form") as info:
        decoded(many + f"--{boundary}--\r\n".encode())
    assert info.value.param == "image"


def test_openai_operations_ditserve_does_not_serve_are_a_400_saying_so():
    """The SDK's videos.remix got 404 "Not Found" (the SDK's NotFoundError: "no such video"),
    videos.edit / extend / create_character a 405 (helper-29's review): each is a 400
    ``unsupported_operation`` naming the operation and what to do instead."""
    import asyncio

    import httpx
    from openai import AsyncOpenAI, BadRequestError

    from deployments.ingress import UNSERVED, api

    async def run():
        client = AsyncOpenAI(base_url="http://t/v1", api_key="unused", max_retries=0,
                             http_client=httpx.AsyncClient(transport=httpx.ASGITransport(api)))
        for operation, call in {"videos.remix": lambda: client.videos.remix("video_1", prompt="a fox"),
                                "images.create_variation": lambda: client.images.create_variation(
                                    image=("a.png", b"x"))}.items():
            with pytest.raises(BadRequestError) as info:
                await call()
            assert info.value.code == "unsupported_operation" and operation in info.value.message
        async with httpx.AsyncClient(transport=httpx.ASGITransport(api), base_url="http://t") as raw:
            for method, path, operation, _ in UNSERVED:
                r = await raw.request(method, path.replace("{video_id}", "video_1").replace("{character_id}", "c"))
                assert r.status_code == 400 and operation in r.json()["error"]["message"], (path, r.text)
            listed = (await raw.get("/openapi.json")).json()["paths"]
        assert not any(path in listed for _, path, _, _ in UNSERVED)  # not part of the published API

    asyncio.run(run())


def test_serve_logs_a_ditserve_answer_as_one_line_and_a_failure_with_its_traceback():
    """helper-42: each 429 (and a handle caller's 400) put an ERROR "Request failed." with a
    20-line traceback on `serve run`'s console and the caller's; Serve logs it so in the
    replica (ray/serve/_private/replica.py). An answer is one line; a failure keeps its trace."""
    import logging

    from deployments.serve_logs import SERVE_LOGGER, answers_are_not_failures
    from pipeline.errors import InternalError, OverloadedError, ReplicaUnavailableError

    answers_are_not_failures()
    answers_are_not_failures()  # once only
    logger = logging.getLogger(SERVE_LOGGER)
    assert sum(type(f).__name__ == "AnswersNotFailures" for f in logger.filters) == 1
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        for error in (OverloadedError("queue full", code="overloaded"),
                      ReplicaUnavailableError("broken", code="replica_broken"),
                      InternalError("batch x failed", code="batch_failed"), RuntimeError("bug")):
            try:
                raise error
            except Exception:  # noqa: BLE001 - as Serve's replica logs what a method raised
                logger.exception("Request failed.")
    finally:
        logger.removeHandler(handler)
    said = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in records]
    assert said == [("INFO", "Request answered 429 overloaded: queue full", False),
                    ("WARNING", "Request answered 503 replica_broken: broken", False),
                    ("ERROR", "Request failed.", True), ("ERROR", "Request failed.", True)]


def test_the_routers_calls_are_not_access_logged_and_its_app_logging_config_stays():
    """The Router's own calls (a lease renewed every second) were a console line each. Left out
    by a filter, not a deployment ``logging_config``, which would replace the application's for
    the Router (helper-44: Serve copies an app's only onto deployments that set none)."""
    import logging

    from deployments.app import deployment_options
    from deployments.config import AppConfig
    from deployments.serve_logs import SERVE_LOGGER, no_access_log

    assert "logging_config" not in deployment_options(AppConfig())["Router"]
    no_access_log()
    no_access_log()
    logger = logging.getLogger(SERVE_LOGGER)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        logger.info("CALL renew_lease OK 0.4ms", extra={"serve_access_log": True})
        logger.info("the Router's own line")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["the Router's own line"]


@pytest.mark.parametrize(("headers", "cross_site"), [
    ({}, False),  # not a browser: the OpenAI SDK, curl
    ({"sec-fetch-site": "same-origin", "origin": "http://127.0.0.1:8000"}, False),  # the playground's own fetch
    ({"sec-fetch-site": "none"}, False),  # typed or bookmarked by the user
    ({"sec-fetch-site": "cross-site", "origin": "http://127.0.0.1:8000"}, True),  # the header wins over Origin
    ({"sec-fetch-site": "same-site"}, True),  # another port or subdomain of the site
    ({"origin": "http://evil.example"}, True),  # a browser without Fetch Metadata
    ({"origin": "http://127.0.0.1:8000"}, False),
    ({"origin": "HTTP://127.0.0.1:8000"}, False),
    ({"origin": "http://localhost:8000"}, True),  # another host name is another origin
    ({"origin": "null"}, True),  # a sandboxed frame's or a file's page
    ({"origin": "https://ditserve.example.com", "x-forwarded-host": "ditserve.example.com"}, False),  # behind a proxy
    ({"origin": "https://evil.example", "x-forwarded-host": "ditserve.example.com"}, True),
    # helper-68: behind a plain-HTTP proxy (no Sec-Fetch-Site) the page's own requests were refused
    ({"origin": "http://ditserve.lan:8080", "x-forwarded-host": "ditserve.lan"}, False),  # nginx's $host: no port
    ({"origin": "http://ditserve.lan", "forwarded": 'for=10.0.0.1;host="ditserve.lan";proto=http'}, False),
    ({"origin": "http://evil.example", "forwarded": "host=ditserve.lan"}, True),
    ({"origin": "http://127.0.0.1.:8000"}, False),  # a trailing dot
    ({"origin": "http://127.0.0.1:8001"}, True),  # another port of the host
    ({"origin": "http://127.0.0.1:abc"}, True),
    ({"origin": "http://[::1]:8000", "x-forwarded-host": "[::1]:8000"}, False),
])
def test_a_browsers_cross_site_request_is_told_apart(headers, cross_site):
    """helper-66: a page of any site made a visitor's browser post an edit to a server without
    keys (a multipart form is a CORS "simple" request, sent without a preflight)."""
    scope = {"type": "http", "method": "POST",
             "headers": [(b"host", b"127.0.0.1:8000"), *((k.encode(), v.encode()) for k, v in headers.items())]}
    assert CrossSiteGuard.cross_site(scope) is cross_site


def test_the_cross_site_guard_stands_aside_where_keys_are_required():
    """With API keys a cross-site page cannot send the key (no browser adds a Bearer header by
    itself, and adding one needs a CORS preflight): the guard only refused proxied same-origin
    calls there (helper-68)."""
    import asyncio

    from starlette.applications import Starlette

    app = Starlette()
    answered: list[int] = []

    async def inner(scope, receive, send):
        answered.append(200)

    async def send(message):
        if message["type"] == "http.response.start":
            answered.append(message["status"])

    async def receive():
        return {"type": "http.request", "body": b""}

    guard = CrossSiteGuard(inner)
    scope = {"type": "http", "method": "POST", "path": "/v1/videos", "app": app,
             "headers": [(b"host", b"127.0.0.1:8000"), (b"origin", b"http://evil.example")]}
    asyncio.run(guard(scope, receive, send))
    app.state.api_keys = (b"sk-" + b"a" * 40,)
    asyncio.run(guard(scope, receive, send))
    assert answered == [403, 200]


def test_a_handle_callers_python_values_are_read_as_json_brings_them():
    """helper-74: through a handle, a numpy seed was a 400 'valid integer' and a tuple a 400
    'valid list'; an edit's image as base64 text was told 'at most 2000 characters' as if a
    shorter string would do. Integral numbers are ints and tuples lists; a file given as text is
    told to be bytes, at any length. Booleans stay booleans (not 0/1), numpy's too."""
    import numpy as np

    from pipeline.contract.edits import validate_edit_request

    knobs = (np.int64(2), np.int32(1))
    request = validate_image_request({"prompt": "a", "seed": np.int64(3), "num_inference_steps": np.int32(8),
                                      "cache_dit_params": {"Fn_compute_blocks": knobs[0], "Bn_compute_blocks": knobs[1],
                                                           "scm_compute_bins": (4,), "scm_cache_bins": (4,)}}, LIMITS)
    assert (request.seed, request.num_inference_steps) == (3, 8) and type(request.seed) is int
    assert list(request.cache_dit_params.scm_cache_bins) == [4]  # a tuple was a 400 'valid list'
    assert refused({"prompt": "a", "seed": True}).param == "seed"
    assert refused({"prompt": "a", "seed": np.True_}).param == "seed"
    # numpy's booleans are booleans (helper-79: np.True_ was a 400 'valid boolean'); its floats floats
    flags = validate_image_request({"prompt": "a", "enable_cache_dit": np.True_, "stream": np.False_,
                                    "guidance_scale": np.float32(2.5), "cfg_gate_step": np.float64(0.5)}, LIMITS)
    assert (flags.enable_cache_dit, flags.stream, flags.guidance_scale, flags.cfg_gate_step) == (True, False, 2.5, 0.5)
    assert type(flags.enable_cache_dit) is bool
    with pytest.raises(InvalidRequestError) as info:
        validate_edit_request({"prompt": "a", "image": "iVBORw0KGgo" * 1000}, LIMITS)
    assert info.value.param == "image" and info.value.message.startswith("image: expected file bytes (an upload; ")
