"""End to end through real Ray Serve, real HTTP and the real OpenAI client."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from openai import BadRequestError, NotFoundError
from PIL import Image

from tests.helpers import TINY_ARGS, openai_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(deploy):
    return deploy(TINY_ARGS)


@pytest.fixture(scope="module")
def client(url):
    return openai_client(url)


def png_of(response) -> bytes:
    return base64.b64decode(response.data[0].b64_json)


def generate(client, prompt="a red circle", **extra):
    size = extra.pop("size", "64x48")
    return client.images.generate(prompt=prompt, size=size, response_format="b64_json",
                                  extra_body={"num_inference_steps": 4, **extra})


def test_image_is_a_png_of_the_requested_size(client):
    response = generate(client, seed=1, size="80x48")
    image = Image.open(io.BytesIO(png_of(response)))
    assert image.format == "PNG" and image.size == (80, 48) and image.mode == "RGB"
    # OpenAI's ImagesResponse fields, as the streamed completed event carries them (they were None;
    # its quality values are levels, none of which applies: left out)
    assert (response.size, response.output_format, response.quality, response.background) == (
        "80x48", "png", None, "opaque")
    meta = response.model_extra["ditserve"]
    assert meta["batch_size"] >= 1 and meta["world_size"] == 1 and meta["seed"] == 1
    assert set(meta["timings_ms"]) == {"queue", "denoise", "decode", "total"}
    assert meta["acceleration"]["cache_dit"]["computed_steps"] == 4
    assert meta["signature"].startswith("tiny-flux 80x48 steps=4")


@pytest.mark.parametrize(("output_format", "compression", "pillow"), [
    ("jpeg", 40, "JPEG"), ("webp", 80, "WEBP"), ("png", None, "PNG")])
def test_output_formats_through_the_openai_client(client, output_format, compression, pillow):
    """OpenAI's ``output_format`` / ``output_compression``: the image decodes in that format
    at the requested size, close to the PNG of the same seed (lossy formats)."""
    options = {"output_format": output_format}
    if compression is not None:
        options["output_compression"] = compression
    response = client.images.generate(prompt="a red circle", size="80x48", response_format="b64_json",
                                      extra_body={"num_inference_steps": 4, "seed": 5}, **options)
    assert response.output_format == output_format
    image = Image.open(io.BytesIO(png_of(response)))
    assert image.format == pillow and image.size == (80, 48)
    reference = Image.open(io.BytesIO(png_of(generate(client, seed=5, size="80x48"))))
    diff = np.abs(np.asarray(image.convert("RGB"), dtype=np.int16) - np.asarray(reference, dtype=np.int16))
    assert diff.mean() <= (0 if output_format == "png" else 12)


def test_n_images_per_request(client):
    response = generate(client, seed=2, n=3)
    assert len(response.data) == 3
    pngs = {base64.b64decode(d.b64_json) for d in response.data}
    assert len(pngs) == 3


def test_same_seed_same_bytes_and_different_seeds_differ(client):
    a, b = png_of(generate(client, seed=42)), png_of(generate(client, seed=42))
    c = png_of(generate(client, seed=43))
    assert a == b
    pixels = lambda png: np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)  # noqa: E731
    assert np.abs(pixels(a) - pixels(c)).max() > 10


def test_concurrent_requests_are_batched(client):
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: generate(client, prompt=f"a shape {i}", seed=i), range(8)))
    metas = [r.model_extra["ditserve"] for r in responses]
    batches = {m["batch_id"] for m in metas}
    assert len(batches) < 8
    assert max(m["batch_size"] for m in metas) > 1
    assert len({m["request_id"] for m in metas}) == 8


def test_models_health_and_stats(url):
    import openai

    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-flux"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve("tiny-flux").model_dump(exclude_none=True) == models["data"][0]  # (helper-59: 404)
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-image-1")
    assert info.value.body["code"] == "model_not_found" and "available: 'tiny-flux'" in info.value.body["message"]
    for path in ("/v1/models/", "/v1/models/tiny-flux/"):  # a trailing slash: redirected (helper-61: a 404 for '')
        assert httpx.get(f"{url}{path}", follow_redirects=True).status_code == 200, path
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    stats = httpx.get(f"{url}/v1/stats").json()
    assert stats["router"]["counters"]["batches"] >= 1


@pytest.mark.parametrize("body, field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 2001}, "prompt"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 5}, "n"),
    ({"prompt": "a", "size": "big"}, "size"),
    ({"prompt": "a", "size": "60x60"}, "size"),
    ({"prompt": "a", "size": "1024x1024"}, "size"),
    ({"prompt": "a", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "a", "num_inference_steps": 1000}, "num_inference_steps"),
    ({"prompt": "a", "guidance_scale": -2}, "guidance_scale"),
    ({"prompt": "a", "enable_cache_ditt": True}, "enable_cache_ditt"),
    ({"prompt": "a", "response_format": "url"}, "response_format"),
    ({"prompt": "a", "cache_dit_params": {"Fn_compute_block": 2}}, "cache_dit_params"),
    ({"prompt": "a", "cfg_gate_step": 0}, "cfg_gate_step"),
    ({"prompt": "a", "attention_backend_override": "nope"}, "attention_backend_override"),
])
def test_bad_input_is_400_naming_the_field(url, body, field):
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert field in error["message"]


def test_non_finite_guidance_and_malformed_json(url):
    r = httpx.post(f"{url}/v1/images/generations", content=b'{"prompt": "a", "guidance_scale": NaN}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guidance_scale"
    r = httpx.post(f"{url}/v1/images/generations", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/images/generations", content=b"{not json", timeout=60)  # no Content-Type
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


def test_openai_client_sees_typed_errors_and_server_keeps_serving(client):
    with pytest.raises(NotFoundError) as info:
        client.images.generate(model="dall-e-3", prompt="a", response_format="b64_json")
    assert info.value.body["param"] == "model"
    with pytest.raises(BadRequestError):
        client.images.generate(prompt="a", n=9, response_format="b64_json")
    assert len(generate(client, seed=5).data) == 1


def test_the_sdk_does_not_retry_a_request_past_its_own_deadline(url):
    """OpenAI's SDK retries every status >= 500 twice unless told not to: a request past its own
    ``timeout_s`` (504) ran three times, each re-queued and started again (helper-29's review).
    The 504 says ``x-should-retry: false``; a 429 still leaves retrying to the SDK."""
    import httpx
    from openai import InternalServerError, OpenAI

    sent = []
    http_client = httpx.Client(event_hooks={"request": [lambda request: sent.append(request.url.path)]})
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, http_client=http_client)
    with pytest.raises(InternalServerError) as info:
        client.images.generate(prompt="a red circle", size="256x256", response_format="b64_json",
                               extra_body={"num_inference_steps": 100, "timeout_s": 0.5})
    assert info.value.status_code == 504 and info.value.response.headers["x-should-retry"] == "false"
    assert sent == ["/v1/images/generations"]  # one attempt, not three


HANDLE_SCRIPT = textwrap.dedent("""
    import base64, json, sys
    import ray
    from ray import serve
    from pipeline.errors import InvalidRequestError
    ray.init(address=sys.argv[1], log_to_driver=False)
    handle = serve.get_app_handle("ditserve")
    body = json.loads(sys.argv[2])
    result = handle.generate.remote(body).result()
    out = {"png": result.data[0].b64_json, "type": type(result).__name__,
           "keywords_png": handle.generate.remote(**body).result().data[0].b64_json}
    try:
        handle.generate.remote({"prompt": "", "n": 0}).result()
    except InvalidRequestError as exc:
        out["error"] = {"param": exc.param, "message": exc.message, "status": exc.status_code}
    try:
        handle.generate.remote(body, seed=2).result()
    except InvalidRequestError as exc:
        out["both"] = {"message": exc.message, "status": exc.status_code}
    print("RESULT" + json.dumps(out))
""")


def test_handle_from_a_separate_driver_matches_http(client, ray_cluster):
    body = {"prompt": "a blue square", "seed": 9, "num_inference_steps": 4, "size": "64x48"}
    http_png = png_of(client.images.generate(
        prompt=body["prompt"], size=body["size"], response_format="b64_json",
        extra_body={"seed": 9, "num_inference_steps": 4}))
    proc = subprocess.run([sys.executable, "-c", HANDLE_SCRIPT, ray_cluster["gcs_address"], json.dumps(body)],
                          capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    out = json.loads(line[0][len("RESULT"):])
    assert out["type"] == "ImageGenerationResponse"
    assert base64.b64decode(out["png"]) == http_png
    assert out["keywords_png"] == out["png"]  # generate.remote(prompt=..., seed=...): a TypeError was raised
    assert out["both"]["status"] == 400 and "not both (keywords: seed)" in out["both"]["message"]
    assert out["error"]["status"] == 400 and out["error"]["param"] == "prompt"
    assert "n must be" in out["error"]["message"]


def test_acceleration_rejections_list_all_reasons_before_queueing(url):
    before = httpx.get(f"{url}/v1/stats").json()["router"]["counters"]
    r = httpx.post(f"{url}/v1/images/generations", timeout=60, json={
        "prompt": "a", "attention_backend_override": "fa",
        "cache_dit_params": {"Fn_compute_blocks": 9, "Bn_compute_blocks": 4}})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    for part in ("'fa' cannot run", "needs a CUDA device", "flash_attn", "float32", "exceeds the model's 10"):
        assert part in message, message
    r = httpx.post(f"{url}/v1/images/generations", timeout=60, json={
        "prompt": "a", "num_inference_steps": 8, "cache_dit_params": {"scm_compute_bins": [2], "scm_cache_bins": [2]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_dit_params"
    assert httpx.get(f"{url}/v1/stats").json()["router"]["counters"] == before  # no batch, rejection or failure


def test_accelerations_through_http(client, url):
    body = {"negative_prompt": "blurry", "true_cfg_scale": 3.0, "cfg_gate_step": 0.5, "enable_cache_dit": True,
            "cache_dit_params": {"scm_preset": "fast", "scm_policy": "static"},
            "attention_backend_override": "torch_math"}
    meta = generate(client, seed=3, **body).model_extra["ditserve"]["acceleration"]
    assert meta["cache_dit"]["active"] and meta["cache_dit"]["cached_steps"] > 0
    assert meta["attention_backend"] == "torch_math" and meta["cfg_gate"]["reused_steps"] == 2
    replicas = httpx.get(f"{url}/v1/stats").json()["router"]["replicas"]
    deadline = time.monotonic() + 5  # replicas report their counters every routing_stats_period_s
    while time.monotonic() < deadline and not any(s.get("mounts") for s in replicas.values()):
        time.sleep(0.2)
        replicas = httpx.get(f"{url}/v1/stats").json()["router"]["replicas"]
    assert any(s.get("mounts", 0) >= 1 for s in replicas.values()), replicas
    assert all(s["reported"] for s in replicas.values() if s.get("mounts"))  # a replica's first report came


def test_cli_writes_the_format_of_its_suffix_and_prints_envelope_errors(url, tmp_path, capsys):
    from deployments.cli import main

    out = tmp_path / "circle.webp"
    assert main(["generate", "a red circle", "-o", str(out), "--url", url, "--size", "64x48", "--steps", "2"]) == 0
    assert Image.open(out).format == "WEBP" and Image.open(out).size == (64, 48)
    capsys.readouterr()
    assert main(["generate", "", "-o", str(tmp_path / "x.png"), "--url", url]) == 1
    err = capsys.readouterr().err
    assert err == "error 400 invalid_value (prompt): prompt must not be empty\n", err


def test_a_cross_site_browser_post_is_refused_before_it_runs(url):
    """helper-66: a page of another site posted an edit through its visitor's browser (a form
    needs no CORS preflight), and it ran on this server without keys. 403 before anything is
    queued; the same form from the server's own page, or from a client that is not a browser,
    goes through."""
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 40, 40)).save(buffer, format="PNG")
    form = {"data": {"prompt": "a blue square", "num_inference_steps": "2"},
            "files": {"image": ("in.png", buffer.getvalue(), "image/png")}}
    before = httpx.get(f"{url}/v1/stats", timeout=30).json()["router"]["counters"].get("requests", 0)
    for headers in ({"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}, {"Origin": "null"},
                    {"Origin": "http://evil.example"}):
        refused = httpx.post(f"{url}/v1/images/edits", headers=headers, timeout=60, **form)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "cross_site_request"
    video = httpx.post(f"{url}/v1/videos", headers={"Sec-Fetch-Site": "cross-site"}, data={"prompt": "x"}, timeout=60)
    assert video.status_code == 403 and video.json()["error"]["code"] == "cross_site_request"
    assert httpx.get(f"{url}/v1/stats", timeout=30).json()["router"]["counters"].get("requests", 0) == before
    own = url.split("//", 1)[1].split("/", 1)[0]
    for headers in ({"Origin": f"http://{own}", "Sec-Fetch-Site": "same-origin"}, {}):
        answered = httpx.post(f"{url}/v1/images/edits", headers=headers, timeout=120, **form)
        assert answered.status_code == 200, answered.text
