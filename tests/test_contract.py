"""Request validation (every problem in one error, naming the field) and the batch signature."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.contract.images import validate_image_request
from pipeline.contract.limits import ServingLimits
from pipeline.contract.videos import validate_video_request
from pipeline.errors import InvalidRequestError, ModelNotFoundError
from pipeline.modes import DualMode, GuidanceMode
from pipeline.sampling import AccelerationDefaults, SamplingParams, resolve, resolve_video
from pipeline.signature import SIGNATURE_TABLE, BatchSignature

LIMITS = ServingLimits(model_name="tiny-flux", spatial_factor=8, default_width=64, default_height=64,
                       default_steps=16, default_guidance_scale=3.5, max_n=4, max_pixels=65536, max_steps=100,
                       max_prompt_chars=100)


def reasons(body: dict) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        validate_image_request(body, LIMITS)
    return info.value


@pytest.mark.parametrize("body, field, words", [
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": "   "}, "prompt", "must not be empty"),
    ({"prompt": "x" * 101}, "prompt", "at most 100"),
    ({"prompt": "a", "n": 0}, "n", "between 1 and 4"),
    ({"prompt": "a", "n": 5}, "n", "between 1 and 4"),
    ({"prompt": "a", "size": "64"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "a", "size": "axb"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "a", "size": "60x64"}, "size", "multiples of 8"),
    ({"prompt": "a", "size": "512x512"}, "size", "at most 65536"),
    # helper-48: a six-digit side was told "size must look like '1024x1024'"
    ({"prompt": "a", "size": "100000x100000"}, "size", "has 10000000000 pixels; at most 65536"),
    ({"prompt": "a", "size": "1234567890x8"}, "size", "WIDTHxHEIGHT"),  # past 9 digits: no size
    ({"prompt": "a", "num_inference_steps": 0}, "num_inference_steps", "between 1 and 100"),
    ({"prompt": "a", "num_inference_steps": 101}, "num_inference_steps", "between 1 and 100"),
    ({"prompt": "a", "guidance_scale": -1}, "guidance_scale", ">= 0"),
    ({"prompt": "a", "guidance_scale": float("inf")}, "guidance_scale", "finite"),
    ({"prompt": "a", "true_cfg_scale": float("nan")}, "true_cfg_scale", "finite"),
    ({"prompt": "a", "response_format": "url"}, "response_format", "b64_json"),
    ({"prompt": "a", "output_format": "gif"}, "output_format", "one of png, jpeg, webp"),
    ({"prompt": "a", "output_format": "jpeg", "output_compression": 101}, "output_compression", "between 0 and 100"),
    ({"prompt": "a", "output_format": "webp", "output_compression": -1}, "output_compression", "between 0 and 100"),
    ({"prompt": "a", "output_compression": 50}, "output_compression", "jpeg or webp, not png"),
    ({"prompt": "a", "priority": "urgent"}, "priority", "one of interactive, batch"),
    ({"prompt": "a", "enable_cache_dti": True}, "enable_cache_dti",
     "unknown field 'enable_cache_dti' (did you mean 'enable_cache_dit'?)"),
    ({"prompt": "a", "sizee": "64x64"}, "sizee", "unknown field 'sizee' (did you mean 'size'?)"),
    # OpenAI's own fields no ditserve model takes: said so (helper-63: "unknown field 'quality'")
    ({"prompt": "a", "quality": "high"}, "quality", "quality: a field of OpenAI's gpt-image and DALL-E models, which "
                                                    "ditserve's models do not take; send the request without it"),
    ({"prompt": "a", "background": "transparent"}, "background", "opaque images only; send auto or opaque"),
    ({"prompt": "a", "background": "Opaque"}, "background", "auto, opaque"),
    ({"prompt": "a", "cfg_gate_step": 0}, "cfg_gate_step", "(0, 1]"),
    ({"prompt": "a", "cfg_gate_step": 1.5}, "cfg_gate_step", "(0, 1]"),
    ({"prompt": "a", "attention_backend_override": "flash"}, "attention_backend_override", "one of"),
    ({"prompt": "a", "cache_dit_params": {"Fn_compute_block": 1}}, "cache_dit_params", "unknown key"),
    ({"prompt": "a", "cache_dit_params": {"Fn_compute_blocks": "8"}}, "cache_dit_params", "integer"),
    ({"prompt": "a", "cache_dit_params": {"scm_preset": "turbo"}}, "cache_dit_params", "slow"),
    ({"prompt": "a", "cache_dit_params": {"scm_compute_bins": [8]}}, "cache_dit_params", "together"),
    ({"prompt": "a", "cache_dit_params": {"secondary": 3}}, "cache_dit_params", "secondary"),
    ({"prompt": "a", "cache_dit_params": {"secondary": {"scm_preset": "fast"}}}, "cache_dit_params", "secondary"),
    ({"prompt": "a", "seed": -1}, "seed", "greater than or equal"),
    ({"prompt": 3}, "prompt", "string"),
    ({"prompt": "a", "safety_identifier": "x" * 257}, "safety_identifier", "at most 256"),
])
def test_each_bad_field_is_named(body, field, words):
    err = reasons(body)
    assert err.param == field
    assert words in err.message
    assert err.status_code == 400


def test_every_problem_is_listed_at_once():
    err = reasons({"prompt": "", "n": 9, "size": "65x64", "typo": 1, "cfg_gate_step": 2,
                   "cache_dit_params": {"bad": 1}})
    for part in ("prompt", "n must be", "size 65x64", "'typo'", "cfg_gate_step", "'bad'"):
        assert part in err.message


def test_field_names_that_are_not_strings_are_named():
    """A handle call's dict may have any keys: a 400 naming ``body`` (a tuple key was named as the
    field, a number one an error deep in validation; helper-33's review)."""
    for key in (1, ("a",), 0, None):
        with pytest.raises(InvalidRequestError, match="field names are strings") as info:
            validate_image_request({"prompt": "x", key: 2}, LIMITS)
        assert info.value.param == "body"


def test_unknown_model_is_404():
    with pytest.raises(ModelNotFoundError) as info:
        validate_image_request({"prompt": "a", "model": "flux-pro"}, LIMITS)
    assert info.value.status_code == 404 and info.value.param == "model"


def test_nested_extra_body_is_merged_and_clashes_rejected():
    req = validate_image_request({"prompt": "a", "extra_body": {"seed": 5, "num_inference_steps": 3}}, LIMITS)
    assert (req.seed, req.num_inference_steps) == (5, 3)
    err = reasons({"prompt": "a", "seed": 1, "extra_body": {"seed": 5}})
    assert "repeats" in err.message
    # helper-47: was "unknown field 'extra_body' (did you mean 'extra_body'?)"
    err = reasons({"prompt": "a", "extra_body": {"extra_body": {"seed": 1}}})
    assert err.param == "extra_body" and err.message.startswith("extra_body holds an extra_body: one level is merged")
    assert "did you mean" not in err.message


def test_null_means_the_fields_default():
    """OpenAI's API has ``n``, ``stream``, ``response_format``, ``output_format`` nullable and
    its SDK sends ``None`` as ``null``: every optional field given ``null`` (top level, in a
    nested ``extra_body``, or ``extra_body`` itself) is the request without it. Those four
    were 400s ('Input should be a valid ...')."""
    from pipeline.contract.images import ImageGenerationRequest
    from pipeline.contract.videos import VideoGenerationRequest

    for model, validate in ((ImageGenerationRequest, validate_image_request),
                            (VideoGenerationRequest, lambda body, _: validate_video_request(body, VIDEO))):
        plain = validate({"prompt": "a"}, LIMITS)
        for name, field in model.model_fields.items():
            if field.is_required():
                continue
            assert validate({"prompt": "a", name: None}, LIMITS) == plain, name
            assert validate({"prompt": "a", "extra_body": {name: None}}, LIMITS) == plain, name
    assert validate_image_request({"prompt": "a", "extra_body": None}, LIMITS) == validate_image_request(
        {"prompt": "a"}, LIMITS)
    # a null is no value: it does not clash with the other place (both were 400 'repeats')
    assert validate_image_request({"prompt": "a", "seed": 1, "extra_body": {"seed": None}}, LIMITS).seed == 1
    assert validate_image_request({"prompt": "a", "seed": None, "extra_body": {"seed": 2}}, LIMITS).seed == 2
    err = reasons({"prompt": "a", "extra_body": 5})  # was "unknown field 'extra_body'"
    assert err.param == "extra_body" and "must be an object" in err.message
    assert reasons({"prompt": None}).param == "prompt"  # a required field stays required


def test_resolve_applies_defaults_and_diffusers_cfg_rule():
    p = resolve(validate_image_request({"prompt": "a", "true_cfg_scale": 4.0}, LIMITS), LIMITS)
    assert (p.width, p.height, p.num_inference_steps, p.embedded_guidance_scale) == (64, 64, 16, 3.5)
    assert not p.guided and p.cfg_scale == 1.0  # no negative prompt: no true CFG
    q = resolve(validate_image_request({"prompt": "a", "true_cfg_scale": 4.0, "negative_prompt": ""}, LIMITS), LIMITS)
    assert q.guided and q.guidance_mode == GuidanceMode.TRUE_CFG and q.cfg_scale == 4.0
    assert 0 <= p.seed < 2**31


def test_cache_dit_resolution():
    defaults_on = AccelerationDefaults(enable_cache_dit=True)
    base = {"prompt": "a"}
    off = resolve(validate_image_request({**base, "enable_cache_dit": False}, LIMITS), LIMITS, defaults_on)
    assert not off.enable_cache_dit and off.cache_dit_params is None  # False always wins
    follow = resolve(validate_image_request(base, LIMITS), LIMITS, defaults_on)
    assert follow.enable_cache_dit
    dual = dataclasses.replace(LIMITS, dual_mode=DualMode.PAIRED)
    a = resolve(validate_image_request({**base, "enable_cache_dit": True, "cache_dit_params": {
        "Fn_compute_blocks": 2, "secondary": {"max_warmup_steps": 1, "Bn_compute_blocks": 0}}}, dual), dual)
    b = resolve(validate_image_request({**base, "enable_cache_dit": True, "cache_dit_params": {
        "secondary": {"Bn_compute_blocks": 0, "max_warmup_steps": 1}, "Fn_compute_blocks": 2}}, dual), dual)
    assert BatchSignature.of(a) == BatchSignature.of(b)  # order-insensitive, nested included
    hash(BatchSignature.of(a))
    error = reasons({**base, "cache_dit_params": {"secondary": {"max_warmup_steps": 1}}})
    assert error.param == "cache_dit_params" and "only for models with two transformers" in str(error)


def test_signature_table_covers_every_field():
    """Adding a SamplingParams field without deciding its signature membership fails here."""
    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(SIGNATURE_TABLE)
    expected_in = {"model", "width", "height", "num_frames", "num_inference_steps", "guidance_mode", "cfg_scale",
                   "embedded_guidance_scale", "enable_cache_dit", "cache_dit_params", "cfg_gate_fraction",
                   "attention_backend", "cfg_scale_2", "boundary_ratio", "lora", "input_mode", "strength",
                   "num_input_images"}
    assert {k for k, v in SIGNATURE_TABLE.items() if v} == expected_in


def test_signature_ignores_per_request_fields():
    r = validate_image_request({"prompt": "a", "seed": 1}, LIMITS)
    s = validate_image_request({"prompt": "b", "seed": 2, "negative_prompt": "c", "n": 3}, LIMITS)
    t = validate_image_request({"prompt": "a", "seed": 1, "num_inference_steps": 3}, LIMITS)
    assert BatchSignature.of(resolve(r, LIMITS)) == BatchSignature.of(resolve(s, LIMITS))
    assert BatchSignature.of(resolve(r, LIMITS)) != BatchSignature.of(resolve(t, LIMITS))


VIDEO = dataclasses.replace(LIMITS, model_name="tiny-wan-moe", spatial_factor=16, default_steps=8,
                            default_guidance_scale=5.0, guidance_embeds=False, guidance_style=GuidanceMode.CFG,
                            dual_mode=DualMode.BOUNDARY, temporal_factor=4, default_num_frames=9, default_fps=8,
                            max_frames=33, default_boundary_ratio=0.875)


@pytest.mark.parametrize("body, field, words", [
    ({"prompt": "a", "num_frames": 10}, "num_frames", "4·k + 1"),
    ({"prompt": "a", "num_frames": 37}, "num_frames", "at most 33"),
    ({"prompt": "a", "seconds": 30}, "seconds", "at most 33"),
    ({"prompt": "a", "seconds": "soon"}, "seconds", "whole number of seconds in ASCII digits"),
    # as strict as size: ASCII digits (not "١", Arabic-Indic one), whole seconds, no silent rounding up
    *(({"prompt": "a", "seconds": bad}, "seconds", "1 to 3600 (OpenAI's values are 4, 8 and 12")
      for bad in ("\u0661", "1e-300", 1e-300, "0.5", 2.0, "0", 0, -4, "+4", " 4", "4\n", "4 ", True, "12345", 3601)),
    ({"prompt": "a", "seconds": 1, "num_frames": 9}, "seconds", "not both"),
    ({"prompt": "a", "size": "512x512"}, "size", "at most 65536"),
    ({"prompt": "a", "size": "72x64"}, "size", "multiples of 16"),
    ({"prompt": "a", "boundary_ratio": 1.5}, "boundary_ratio", "[0, 1]"),
    ({"prompt": "a", "boundary_ratio": -0.1}, "boundary_ratio", "[0, 1]"),
    ({"prompt": "a", "fps": 0}, "fps", "between 1 and 120"),
    ({"prompt": "a", "n": 2}, "n", "unknown field"),
    ({"prompt": "a", "sizee": "64x64"}, "sizee", "unknown field 'sizee' (did you mean 'size'?)"),
    # OpenAI's JSON forms of input_reference (they were 'Input should be a valid bytes')
    ({"prompt": "a", "input_reference": {"image_url": "https://x/a.png"}}, "input_reference", "uploaded image file"),
    ({"prompt": "a", "input_reference": "aGVsbG8="}, "input_reference", "uploaded image file"),
])
def test_video_bad_input_names_the_field(body, field, words):
    with pytest.raises(InvalidRequestError) as info:
        validate_video_request(body, VIDEO)
    assert info.value.param == field and words in str(info.value), str(info.value)


def test_a_value_of_the_wrong_type_is_answered_with_the_fields_allowed_values():
    """helper-59: ``{"priority": 1}`` read "priority: Input should be a valid string", ``fps: 0.5``
    and ``timeout_s: 0`` named no range. Every field of every request model (and of its nested
    objects) has an ``ALLOWED`` text, and pydantic's own errors carry it."""
    from pipeline.cache_dit_params import CacheDiTKnobs, CacheDiTParams
    from pipeline.contract.base import allowed_text
    from pipeline.contract.edits import ImageEditRequest
    from pipeline.contract.images import ImageGenerationRequest
    from pipeline.contract.lora import LoraRequest
    from pipeline.contract.videos import VideoGenerationRequest

    for model in (ImageGenerationRequest, ImageEditRequest, VideoGenerationRequest, CacheDiTKnobs, CacheDiTParams,
                  LoraRequest):
        missing = [f for f in model.model_fields if allowed_text(model, f, VIDEO) is None]
        assert not missing, (model.__name__, missing)
    wrong = (True, 1.5, "x", [1], {"a": 1})
    for validate, limits, model in ((validate_image_request, LIMITS, ImageGenerationRequest),
                                    (validate_video_request, VIDEO, VideoGenerationRequest)):
        for field in set(model.model_fields) - {"model"}:  # (a model that is not served is a 404)
            for value in wrong:
                try:
                    validate({"prompt": "a", field: value}, limits)
                except InvalidRequestError as exc:
                    assert exc.param == field, (field, value, exc.message)
                    assert "Input should" not in exc.message or "; allowed: " in exc.message, (field, value)
    for knob in CacheDiTParams.model_fields:
        for value in wrong:
            try:  # (1.5 is a threshold)
                validate_image_request({"prompt": "a", "cache_dit_params": {knob: value}}, LIMITS)
            except InvalidRequestError as exc:
                assert "Input should" not in exc.message or "; allowed: " in exc.message, (knob, value)
    cases = [({"priority": 1}, "priority: Input should be a valid string, got 1; allowed: one of interactive, batch"),
             ({"fps": 0.5}, "fps: Input should be a valid integer, got 0.5; allowed: an integer from 1 to 120"),
             ({"timeout_s": 0}, "timeout_s: Input should be greater than 0, got 0; allowed: a number of seconds > 0 "
                                "and <= 3600"),
             ({"seconds": 5}, "seconds: 41 frames requested; at most 33 are allowed (at most 4 seconds at 8 fps)"),
             ({"num_frames": 10}, "num_frames must be 4·k + 1"),  # (it said num_frames twice)
             ({"lora": ["a"]}, "lora.0: Input should be an object, got 'a'; allowed: a list of at most 4 objects"),
             ({"cache_dit_params": {"scm_cache_bins": "x"}}, "cache_dit_params.scm_cache_bins: Input should be a "
                                                              "list, got 'x'; allowed: a list of integers")]
    for body, words in cases:
        assert reasons_video(body).message.startswith(words), body
    # the count of problems left out is of distinct ones (helper-61: pydantic's raw errors were counted)
    bad = {field: True for field in ("n", "seed", "size", "user", "negative_prompt", "num_inference_steps",
                                     "guidance_scale", "cfg_gate_step", "timeout_s")}
    assert reasons({"prompt": "a", **bad}).message.endswith("; and 1 more problems")


def reasons_video(body: dict) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        validate_video_request({"prompt": "a", **body}, VIDEO)
    return info.value


def test_video_fields_of_the_model_kind():
    single = dataclasses.replace(VIDEO, model_name="tiny-wan", dual_mode=DualMode.SINGLE, default_boundary_ratio=None)
    for body, field in (({"prompt": "a", "boundary_ratio": 0.5}, "boundary_ratio"),
                        ({"prompt": "a", "guidance_scale_2": 2.0}, "guidance_scale_2"),
                        ({"prompt": "a", "cache_dit_params": {"secondary": {"Fn_compute_blocks": 1}}},
                         "cache_dit_params")):
        with pytest.raises(InvalidRequestError) as info:
            validate_video_request(body, single)
        assert info.value.param == field
    paired = dataclasses.replace(VIDEO, guidance_style=GuidanceMode.AUTOGUIDANCE, dual_mode=DualMode.PAIRED)
    with pytest.raises(InvalidRequestError, match="negative_prompt"):
        validate_video_request({"prompt": "a", "negative_prompt": "b"}, paired)
    with pytest.raises(InvalidRequestError, match="POST /v1/videos"):
        validate_image_request({"prompt": "a"}, VIDEO)
    with pytest.raises(InvalidRequestError, match="/v1/images/generations"):
        validate_video_request({"prompt": "a"}, LIMITS)


def test_an_unguided_videos_second_guidance_scale_is_not_in_its_signature():
    """helper-56: ``guidance_scale_2`` of an unguided request scales no guiding forward; one equal
    to ``guidance_scale`` runs as unset."""
    def sig(**fields):
        return BatchSignature.of(resolve_video(validate_video_request({"prompt": "a", **fields}, VIDEO), VIDEO))

    assert sig(guidance_scale=1.0, guidance_scale_2=3.0) == sig(guidance_scale=1.0)
    assert "guidance_scale_2" not in str(sig(guidance_scale=1.0, guidance_scale_2=3.0))
    assert sig(guidance_scale=4.0, guidance_scale_2=3.0) != sig(guidance_scale=4.0, guidance_scale_2=2.0)
    assert sig(guidance_scale=4.0, guidance_scale_2=4.0) == sig(guidance_scale=4.0)  # helper-57: unset is equal


def test_video_resolution_and_signature():
    p = resolve_video(validate_video_request({"prompt": "a", "seconds": "2", "seed": 3}, VIDEO), VIDEO)
    assert p.num_frames == 17 and p.fps == 8 and p.n == 1  # 4·round(2·8/4) + 1
    assert p.guidance_mode == GuidanceMode.CFG and p.cfg_scale == 5.0 and p.negative_prompt == ""  # Wan: g > 1
    q = resolve_video(validate_video_request({"prompt": "b", "num_frames": 17, "seed": 4, "fps": 24}, VIDEO), VIDEO)
    assert BatchSignature.of(p) == BatchSignature.of(q)  # fps is the container's, not the batch's
    r = resolve_video(validate_video_request({"prompt": "a", "num_frames": 17, "boundary_ratio": 0.5}, VIDEO),
                      VIDEO)
    assert BatchSignature.of(p) != BatchSignature.of(r)
    off = resolve_video(validate_video_request({"prompt": "a", "guidance_scale": 1.0}, VIDEO), VIDEO)
    assert not off.guided and off.negative_prompt is None


def test_priority_defaults_per_route_and_stays_out_of_the_signature():
    batch_videos = dataclasses.replace(VIDEO, default_video_priority="batch")
    assert resolve_video(validate_video_request({"prompt": "a"}, batch_videos), batch_videos).priority == "batch"
    asked = validate_video_request({"prompt": "a", "priority": "interactive"}, batch_videos)
    assert resolve_video(asked, batch_videos).priority == "interactive"
    interactive = resolve(validate_image_request({"prompt": "a", "seed": 1}, LIMITS), LIMITS)
    batch = resolve(validate_image_request({"prompt": "a", "seed": 1, "priority": "batch"}, LIMITS), LIMITS)
    assert interactive.priority == "interactive" and batch.priority == "batch"
    assert BatchSignature.of(interactive) == BatchSignature.of(batch)


def test_a_400_lists_the_checks_across_fields_with_a_fields_own_error():
    """pydantic runs the checks across fields only once every field passed: a size the ranks
    cannot split was not named beside another bad field (helper-37's review), nor was
    ``partial_images`` without ``stream`` or a frame count off the VAE's grid. They are listed,
    also when a required field, an unknown one or one in ``extra_body`` failed, unless a field
    they read failed (its default would stand in for what the caller meant; helper-38's review)."""
    two = dataclasses.replace(LIMITS, world_size=2)

    def said(body, limits=two, validate=validate_image_request):
        with pytest.raises(InvalidRequestError) as info:
            validate(body, limits)
        return str(info.value), info.value.param

    message, param = said({"prompt": "x", "size": "24x24", "cfg_gate_step": 0})
    assert param == "cfg_gate_step" and "cfg_gate_step" in message and "9 latent tokens" in message, message
    message, _ = said({"prompt": 5, "size": "24x24"})  # a required field failed too
    assert "prompt" in message and "9 latent tokens" in message, message
    message, _ = said({"prompt": "x", "seed": -1, "partial_images": 2})
    assert "seed" in message and "partial_images: previews are sent only with stream" in message, message
    message, _ = said({"prompt": "x", "stream": "perhaps", "partial_images": 2})  # a field they read: left out
    assert "stream" in message and "previews are sent only" not in message, message
    for odd in ({"a": 1}, {"the": 1}, {"": 1}, {"extra_body": {"seed": "s"}}):  # each hid the split error
        message, _ = said({"prompt": "x", "size": "24x24", **odd})
        assert "9 latent tokens" in message, (odd, message)
    many = {f"k{i}" + "x" * 5000: 1 for i in range(200)}  # long unknown keys: no work grows with them
    message, _ = said({"prompt": "x", "size": "24x24", **many})
    assert "more problems" in message and len(message) < 2000  # keys echoed cut short (each was 5000 long)
    message, _ = said({"prompt": "x", "seed": "s", "num_frames": 8}, VIDEO, validate_video_request)
    assert "seed" in message and "num_frames must be 4·k + 1" in message, message
    validate_image_request({"prompt": "x", "size": "24x16"}, two)  # and nothing when all is well


def test_sizes_must_split_across_the_ranks_unless_the_model_pads_its_sequence():
    """2 ranks, 24x16 at factor 8: 3 x 2 = 6 tokens split; 24x24: 9 tokens do not. A model
    that pads its split sequence to a multiple of 32 (Z-Image) splits any size across 2."""
    two = dataclasses.replace(LIMITS, world_size=2)
    validate_image_request({"prompt": "x", "size": "24x16"}, two)
    with pytest.raises(InvalidRequestError, match="cannot be split evenly across the replica's 2"):
        validate_image_request({"prompt": "x", "size": "24x24"}, two)
    validate_image_request({"prompt": "x", "size": "24x24"}, dataclasses.replace(two, sequence_multiple=32))
    with pytest.raises(InvalidRequestError, match="cannot be split"):  # 3 ranks do not divide 32, nor 4 x 2 tokens
        validate_image_request({"prompt": "x", "size": "32x16"},
                               dataclasses.replace(two, world_size=3, sequence_multiple=32))
    with pytest.raises(InvalidRequestError) as info:  # the numbers and the rule
        validate_image_request({"prompt": "x", "size": "24x24"}, two)
    assert info.value.param == "size" and str(info.value).startswith("size 24x24 is (24/8)·(24/8) = 9 latent tokens, "
                                                                     "which cannot be split evenly")  # helper-45:
    assert "allowed: sizes whose (width/8)·(height/8) is a multiple of 2" in str(info.value)  # was "size: size"
    with pytest.raises(InvalidRequestError, match=r"^size 8x8 is \(8/8\)·\(8/8\) = 1 latent token, which"):
        validate_image_request({"prompt": "x", "size": "8x8"}, two)


def test_a_video_that_cannot_split_names_its_frames_beside_its_size():
    """48x48 with 9 frames is 3·3·3 = 27 latent tokens on 2 ranks; 5 frames (2 latent frames)
    split. The message named only the size (the same size split with other frames) and gave no
    rule."""
    from pipeline.contract.videos import validate_video_request

    wan = ServingLimits("tiny-wan", 16, 64, 48, 4, 5.0, temporal_factor=4, default_num_frames=5, max_frames=9,
                        guidance_embeds=False, world_size=2)
    validate_video_request({"prompt": "a ball", "size": "48x48", "num_frames": 5}, wan)
    with pytest.raises(InvalidRequestError) as info:
        validate_video_request({"prompt": "a ball", "size": "48x48", "num_frames": 9}, wan)
    message = str(info.value)
    assert info.value.param == "size" and "size 48x48 with num_frames giving 3 latent frames" in message, message
    assert "(48/16)·(48/16)·3 = 27 latent tokens" in message and "multiple of 2" in message
    # the frames each field gives are named by it; with neither, the default's (helper-80: "seconds")
    nine = dataclasses.replace(wan, default_num_frames=9)
    for body, said in (({"seconds": 1, "fps": 8}, "with seconds giving 3 latent frames"),
                       ({}, "with the default num_frames (9, limits.default_num_frames) giving 3 latent frames")):
        with pytest.raises(InvalidRequestError) as info:
            validate_video_request({"prompt": "a ball", "size": "48x48", **body}, nine)
        assert info.value.param == "size" and said in str(info.value), str(info.value)


def test_null_in_cache_dit_params_is_unset():
    """A Cache-DiT key given ``null`` (the SDK's ``None``) is the override without it, at every
    level (``secondary`` too); it was a 400 'Input should be a valid integer'."""
    knobs = {"Fn_compute_blocks": 2, "residual_diff_threshold": 0.2}
    plain = validate_image_request({"prompt": "a", "cache_dit_params": knobs}, LIMITS)
    nulls = {name: None for name in ("Bn_compute_blocks", "max_warmup_steps", "max_continuous_cached_steps",
                                     "enable_taylorseer", "taylorseer_order", "scm_preset", "scm_compute_bins",
                                     "scm_cache_bins", "scm_policy", "secondary")}
    assert validate_image_request({"prompt": "a", "cache_dit_params": {**knobs, **nulls}}, LIMITS) == plain
    from pipeline.cache_dit_params import CacheDiTParams

    nested = CacheDiTParams.model_validate({"secondary": {"Fn_compute_blocks": None, "max_warmup_steps": 3}})
    assert nested == CacheDiTParams.model_validate({"secondary": {"max_warmup_steps": 3}})
    # a secondary that sets no knob is none: a one-transformer model takes it (it was a 400)
    assert validate_image_request({"prompt": "a", "cache_dit_params": {**knobs, "secondary": {"Fn_compute_blocks": None}}},
                                  LIMITS) == plain
    # a misspelt key is refused, null or not (a review found null ones passing)
    for body in ({"Fn_compute_blok": None}, {"secondary": {"Fn_compute_blok": None}}):
        assert "Fn_compute_blok" in reasons({"prompt": "a", "cache_dit_params": body}).message, body
    assert "cache_dit_params.Fn_compute_blocks" in reasons({"prompt": "a", "cache_dit_params": {"Fn_compute_blocks": "2"}}).message


def test_openai_sdk_values_the_contract_takes():
    """Values OpenAI's SDK sends that were refused (helper-29's review): ``size: "auto"`` on a
    generation (its SDK literal; edits took it) is the server's default size, and
    ``safety_identifier`` (the SDK's replacement for the deprecated ``user``) is taken as ``user``
    is: accepted, not used."""
    from pipeline.sampling import AccelerationDefaults, resolve

    auto = resolve(validate_image_request({"prompt": "a", "size": "auto"}, LIMITS), LIMITS, AccelerationDefaults())
    plain = resolve(validate_image_request({"prompt": "a"}, LIMITS), LIMITS, AccelerationDefaults())
    assert (auto.width, auto.height) == (plain.width, plain.height) == (LIMITS.default_width, LIMITS.default_height)
    assert validate_image_request({"prompt": "a", "safety_identifier": "s1", "user": "u1"}, LIMITS).safety_identifier == "s1"


def test_values_that_run_alike_share_a_signature():
    """A field is keyed by what it makes the batch run (helper-51: cfg_gate_step 0.1 and 0.2 of
    6 steps gate at one step, yet never shared a batch): the gate's step (none for an unguided
    request or a 1-step run), the steps an edit's strength runs, Cache-DiT knobs left at or
    set to cache-dit's defaults."""
    def sig(**fields):
        return BatchSignature.of(resolve(validate_image_request({"prompt": "a", **fields}, LIMITS), LIMITS))

    guided = {"negative_prompt": "", "true_cfg_scale": 4.0, "num_inference_steps": 6}
    assert sig(**guided, cfg_gate_step=0.1) == sig(**guided, cfg_gate_step=0.2) != sig(**guided)
    assert sig(**guided, cfg_gate_step=0.2) != sig(**guided, cfg_gate_step=0.5)
    assert "cfg_gate_step=1/6 " in str(sig(**guided, cfg_gate_step=0.2))  # the guide runs 1 of the 6 steps
    assert "cfg_gate_step=3/6 " in str(sig(**guided, cfg_gate_step=0.5))
    assert sig(cfg_gate_step=0.3) == sig(cfg_gate_step=1.0) == sig()  # unguided: nothing to gate
    assert "cfg_gate_step=off " in str(sig())
    one = {**guided, "num_inference_steps": 1}
    assert sig(**one, cfg_gate_step=0.5) == sig(**one)  # the gate would be past the only step
    on = {"enable_cache_dit": True}
    assert sig(**on) == sig(**on, cache_dit_params={"Fn_compute_blocks": 8, "Bn_compute_blocks": 0}) \
        == sig(**on, cache_dit_params={"scm_preset": "none", "scm_policy": "static", "taylorseer_order": 3}) \
        == sig(**on, cache_dit_params={"max_warmup_steps": 8, "residual_diff_threshold": 0.08,
                                      "max_continuous_cached_steps": -1, "enable_taylorseer": False})
    assert sig(**on) != sig(**on, cache_dit_params={"Fn_compute_blocks": 4})
    assert "cache_dit=on{} " in str(sig(**on, cache_dit_params={"Fn_compute_blocks": 8}))
    assert sig(**on, cache_dit_params={"enable_taylorseer": True}) == \
        sig(**on, cache_dit_params={"enable_taylorseer": True, "taylorseer_order": 1})


def test_canonical_cache_dit_params_run_the_same_on_each_transformer():
    """``CacheDiTParams.canonical`` keeps what each transformer runs: a ``secondary`` knob equal
    to the primary's is dropped, one that overrides the primary with cache-dit's default is
    kept, and an order the primary gave for a ``secondary`` that turns TaylorSeer on moves there."""
    from pipeline.cache_dit_params import KNOB_DEFAULTS, CacheDiTParams

    def runs(params: CacheDiTParams, name: str) -> dict:
        full = {**KNOB_DEFAULTS, **params.for_transformer(name).canonical().set_knobs()}
        return full if full["enable_taylorseer"] else {**full, "taylorseer_order": None}

    cases = [{"Fn_compute_blocks": 1, "secondary": {"Fn_compute_blocks": 1}},
             {"Fn_compute_blocks": 1, "secondary": {"Fn_compute_blocks": 8}},
             {"enable_taylorseer": False, "taylorseer_order": 3, "secondary": {"enable_taylorseer": True}},
             {"enable_taylorseer": True, "taylorseer_order": 3, "secondary": {"enable_taylorseer": False}},
             {"max_warmup_steps": 2, "scm_preset": "fast", "scm_policy": "dynamic"},
             {"scm_compute_bins": [2, 2], "scm_cache_bins": [2, 2], "scm_policy": "static"}]
    for case in cases:
        given = CacheDiTParams.model_validate(case)
        canonical = given.canonical()
        assert canonical.canonical() == canonical
        for name in ("transformer", "transformer_2"):
            assert runs(canonical, name) == runs(given, name), (case, name)
        assert canonical.has_mask == given.has_mask and canonical.scm_preset in (None, given.scm_preset)
        assert (canonical.scm_policy or "dynamic") == (given.scm_policy or "dynamic")
    assert CacheDiTParams.model_validate(cases[0]).canonical() == CacheDiTParams(Fn_compute_blocks=1)
    assert CacheDiTParams.model_validate(cases[1]).canonical().secondary.Fn_compute_blocks == 8



def test_background_auto_or_opaque_is_what_every_image_is():
    """``background: "opaque"``, what each answer reports, was a 400 as a field no model takes
    (helper-70); ``auto`` and ``opaque`` now pass, ``transparent`` is refused saying why."""
    for background in ("auto", "opaque", None):
        assert validate_image_request({"prompt": "a", "background": background}, LIMITS).background == background


def test_a_size_its_output_format_cannot_encode_is_a_400_before_it_runs():
    """WebP writes at most 16383 pixels a side and JPEG 65500: such a size passed every check,
    denoised, then failed its batch as its encoder raised (helper-70, on flux-dev-1gpu's limits).
    Each route refuses it naming ``size`` (an edit's own size: ``image``), and so does a video,
    whose thumbnail is WebP; PNG takes it. A default past WebP's side is refused in the config."""
    from pydantic import ValidationError

    from deployments.config import LimitsConfig
    from pipeline.contract.edits import validate_edit_request
    from pipeline.contract.limits import encoding_problem
    from pipeline.modes import InputMode
    from pipeline.sampling import resolve_edit
    from tests.test_image_inputs_contract import picture

    tall = dataclasses.replace(LIMITS, max_pixels=2 ** 21)
    for output_format in ("png", "jpeg"):
        validate_image_request({"prompt": "a", "size": "16x16384", "output_format": output_format}, tall)
    with pytest.raises(InvalidRequestError, match=r"^size 16x16384: output_format webp takes at most 16383") as info:
        validate_image_request({"prompt": "a", "size": "16x16384", "output_format": "webp"}, tall)
    assert info.value.param == "size" and "output_format png" in info.value.message
    validate_image_request({"prompt": "a", "size": "16x16376", "output_format": "webp"}, tall)
    assert "takes at most 65500 pixels" in encoding_problem(16, 65504, "jpeg")
    assert encoding_problem(16, 65504, "png") is None

    editing = dataclasses.replace(tall, input_modes=(InputMode.IMAGE_TO_IMAGE,), max_input_pixels=2 ** 21)
    image = picture((16400, 16))  # no size: the image's own, 16400x16
    with pytest.raises(InvalidRequestError, match=r"^image: the output size 16400x16: output_format webp") as info:
        resolve_edit(validate_edit_request({"prompt": "a", "image": image, "output_format": "webp"}, editing), editing)
    assert info.value.param == "image"
    assert resolve_edit(validate_edit_request({"prompt": "a", "image": image}, editing), editing).width == 16400

    wan = ServingLimits("tiny-wan", 16, 64, 48, 4, 5.0, temporal_factor=4, default_num_frames=5, max_frames=9,
                        guidance_embeds=False, max_pixels=2 ** 21)
    with pytest.raises(InvalidRequestError, match=r"^size 16x16384: a video's thumbnail and previews are webp") as info:
        validate_video_request({"prompt": "a", "size": "16x16384"}, wan)
    assert info.value.param == "size"
    with pytest.raises(ValidationError, match="default_size 16x16384 has a side past 16383 pixels"):
        LimitsConfig(default_size="16x16384", max_pixels=2 ** 21)


def test_list_params_take_a_handle_callers_numpy_integer_as_request_bodies_do():
    """helper-77: ``list_videos(limit=np.int64(3))`` was a 400 'limit must be an integer', where a
    numpy integer in a request body is an int (``json_like``)."""
    import numpy as np

    from pipeline.contract.videos import ListOrder, validate_list_params

    assert validate_list_params(np.int64(3), "asc") == (3, ListOrder.ASC)
    assert validate_list_params(np.uint8(0)) == (0, ListOrder.DESC)
    for bad in (np.int64(101), np.int64(-1), True, np.float64(3.0), 3.0):
        with pytest.raises(InvalidRequestError, match="limit must be an integer from 0 to 100"):
            validate_list_params(bad)
