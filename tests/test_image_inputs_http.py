"""Image inputs through the whole server: OpenAI's SDK ``images.edit`` (multipart), the handle's
``edit``, ``videos.create`` with ``input_reference``, the CLI, and bad uploads answered in
OpenAI's envelope before queueing (real Ray Serve, real HTTP)."""

from __future__ import annotations

import io
import random
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from pipeline.tiny.data import COLORS, Scene, draw
from tests.helpers import TINY_ARGS, openai_client, pixels, router_stats

pytestmark = pytest.mark.slow


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


RED_CIRCLE = png(draw(Scene("red", "circle", "yellow"), random.Random(0)))
NOISE = png(Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))


def right_half_mask(size=(64, 64)) -> bytes:
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (size[0] // 2, 0, size[0], size[1]))
    return png(mask)


def distance_to_blue(image: np.ndarray) -> float:
    """RGB distance of the foreground's median colour (pixels far from the border's) to blue."""
    x = image.astype(np.float64)
    border = np.concatenate([x[0], x[-1], x[:, 0], x[:, -1]])
    foreground = np.sqrt(((x - np.median(border, axis=0)) ** 2).sum(-1)) > 60
    return float(np.sqrt(((np.median(x[foreground], axis=0) - np.array(COLORS["blue"])) ** 2).sum()))


@pytest.fixture(scope="module")
def url(deploy):
    return deploy(TINY_ARGS)


def test_openai_sdk_edits_image_to_image_and_inpainting(url):
    client = openai_client(url)
    response = client.images.edit(image=("in.png", RED_CIRCLE), prompt="a blue square on a yellow background",
                                  extra_body={"seed": 1, "strength": 0.7})
    meta = response.model_extra["ditserve"]
    assert "image_to_image strength=12/16 " in meta["signature"]  # 0.7 of 16 steps runs 12
    out = pixels(response.data[0].b64_json)
    assert out.shape == (64, 64, 3)  # the image's own size (no size given)
    assert distance_to_blue(out) < 0.6 * distance_to_blue(np.asarray(Image.open(io.BytesIO(RED_CIRCLE))))
    inpaint = client.images.edit(image=("in.png", RED_CIRCLE), mask=("mask.png", right_half_mask()),
                                 prompt="a blue square on a yellow background", size="64x64", n=2,
                                 extra_body={"seed": 2, "num_inference_steps": 8})
    assert len(inpaint.data) == 2 and "inpaint strength=8/8 " in inpaint.model_extra["ditserve"]["signature"]
    # several files as image[] (what the SDK sends for a list): this model takes one
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as info:
        client.images.edit(image=[("a.png", RED_CIRCLE), ("b.png", RED_CIRCLE)], prompt="x")
    assert info.value.body["param"] == "image" and "at most 1" in info.value.body["message"]


def test_accelerations_apply_to_edits_unchanged(url):
    """Cache-DiT, CFG gating and a kernel override on an inpainting edit, reported per batch."""
    client = openai_client(url)
    response = client.images.edit(
        image=("in.png", RED_CIRCLE), mask=("mask.png", right_half_mask()), prompt="a blue square",
        extra_body={"seed": 7, "strength": 0.75, "num_inference_steps": 8, "negative_prompt": "blurry",
                    "true_cfg_scale": 3.0, "enable_cache_dit": True, "cfg_gate_step": 0.5,
                    "attention_backend_override": "torch_math",
                    "cache_dit_params": {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "max_warmup_steps": 2}})
    acceleration = response.model_extra["ditserve"]["acceleration"]
    assert acceleration["attention_backend"] == "torch_math"
    cache = acceleration["cache_dit"]
    assert cache["active"] and cache["cached_steps"] + cache["computed_steps"] == 6  # 0.75 of 8 steps
    assert acceleration["cfg_gate"]["reused_steps"] == 3  # the guide runs the first 3 of the 6 steps


def test_an_edit_streams_previews_through_the_sdk(url):
    client = openai_client(url)
    events = list(client.images.edit(image=("in.png", RED_CIRCLE), prompt="a blue square", stream=True,
                                     partial_images=2, extra_body={"seed": 3}))
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]  # OpenAI's
    assert [type(e).__name__ for e in events] == ["ImageEditPartialImageEvent"] * 2 + ["ImageEditCompletedEvent"]
    assert "image_to_image" in events[-1].model_extra["ditserve"]["signature"]


def test_an_edit_streams_when_stream_is_given_in_extra_body(url):
    """``extra_body[stream]=true`` (a form's nested field) streams as ``stream=true`` does: the
    route decides after the request's fields are merged (it was a 400 'answered by edit_stream')."""
    form = {"prompt": "a blue square", "seed": "3", "extra_body[stream]": "true", "extra_body[partial_images]": "1"}
    with httpx.stream("POST", f"{url}/v1/images/edits", data=form, files={"image": ("in.png", RED_CIRCLE, "image/png")},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        kinds = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert kinds == ["image_edit.partial_image", "image_edit.completed"]


def test_edits_batch_with_each_other_and_equal_each_run_alone(url):
    """Concurrent edits of different images share a batch (images are per request) and each
    answer equals that edit sent alone."""
    images = [RED_CIRCLE, png(draw(Scene("green", "star", "blue"), random.Random(1))),
              png(draw(Scene("white", "square", "red"), random.Random(2)))]

    def form(i, image):
        return {"prompt": f"edit {i}", "seed": str(i), "strength": "0.6", "num_inference_steps": "8"}, \
            {"image": ("in.png", image, "image/png")}

    async def send_all():
        async with httpx.AsyncClient(timeout=120) as client:
            import asyncio

            return await asyncio.gather(*[client.post(f"{url}/v1/images/edits", data=form(i, im)[0],
                                                      files=form(i, im)[1]) for i, im in enumerate(images)])

    import asyncio

    together = asyncio.run(send_all())
    assert all(r.status_code == 200 for r in together), [r.text for r in together]
    assert max(r.json()["ditserve"]["batch_size"] for r in together) > 1
    for i, (image, r) in enumerate(zip(images, together, strict=True)):
        data, files = form(i, image)
        alone = httpx.post(f"{url}/v1/images/edits", data=data, files=files, timeout=120).json()
        assert np.abs(pixels(alone["data"][0]["b64_json"]).astype(int)
                      - pixels(r.json()["data"][0]["b64_json"]).astype(int)).max() <= 1


def test_the_handle_edits_with_image_bytes(url):
    from ray import serve

    handle = serve.get_app_handle("ditserve")
    result = handle.edit.remote({"prompt": "a blue square", "image": RED_CIRCLE, "mask": right_half_mask(),
                                 "seed": 4, "num_inference_steps": 6}).result(timeout_s=120)
    assert "inpaint" in result.ditserve.signature and len(result.data) == 1
    from pipeline.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        handle.edit.remote({"prompt": "x", "image": b"not an image"}).result(timeout_s=60)
    assert info.value.param == "image"


@pytest.mark.parametrize("case, files, data, status, param", [
    ("not an image", {"image": ("a.png", b"hello", "image/png")}, {}, 400, "image"),
    ("truncated", {"image": ("a.png", NOISE[:len(NOISE) // 2], "image/png")}, {}, 400, "image"),
    ("image bomb", {"image": ("a.png", png(Image.new("1", (12000, 12000))), "image/png")}, {}, 400, "image"),
    # over limits.max_input_pixels, 16 x max_pixels by default (300 x 300, over max_pixels, is scaled down)
    ("over max_input_pixels", {"image": ("a.png", png(Image.new("RGB", (1100, 1000))), "image/png")}, {}, 400,
     "image"),
    ("mask size", {"image": ("a.png", RED_CIRCLE, "image/png"), "mask": ("m.png", right_half_mask((32, 32)),
                                                                           "image/png")}, {}, 400, "mask"),
    ("alpha-less mask", {"image": ("a.png", RED_CIRCLE, "image/png"),
                         "mask": ("m.png", png(Image.new("RGB", (64, 64))), "image/png")}, {}, 400, "mask"),
    ("strength", {"image": ("a.png", RED_CIRCLE, "image/png")}, {"strength": "1.5"}, 400, "strength"),
    ("no image", {}, {"prompt": "x"}, 400, "image"),
    ("image as text", {}, {"image": "aGVsbG8="}, 400, "image"),
    ("a file in a text field", {"image": ("a.png", RED_CIRCLE, "image/png"),
                                "seed": ("s.txt", b"3", "text/plain")}, {}, 400, "seed"),
])
def test_bad_uploads_are_refused_in_the_envelope_before_queueing(url, case, files, data, status, param):
    before = router_stats(url)["counters"]
    r = httpx.post(f"{url}/v1/images/edits", data={"prompt": "a blue square", **data}, files=files or None,
                   timeout=60)
    assert r.status_code == status, (case, r.text)
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", (case, error)
    assert "Traceback" not in error["message"]
    assert router_stats(url)["counters"] == before  # never reached the Router: no batch, rejection or failure


def test_edit_bodies_over_the_limit_and_json_are_refused(deploy):
    url = deploy({**TINY_ARGS, "limits": {"max_body_bytes": 64 * 1024}})
    big = png(Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)))
    r = httpx.post(f"{url}/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", big, "image/png")},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.post(f"{url}/v1/images/edits", json={"prompt": "x", "image": "aGVsbG8="}, timeout=60)
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/images/edits", data={"prompt": "x"},
                      files={"image": ("a.png", RED_CIRCLE, "image/png")}, timeout=120).status_code == 200


def test_cli_edit_turns_a_red_circle_bluer(url, tmp_path, capsys):
    from deployments.cli import main

    source, out = tmp_path / "in.png", tmp_path / "out.png"
    source.write_bytes(RED_CIRCLE)
    assert main(["edit", str(source), "a blue square on a yellow background", "--strength", "0.7", "-o", str(out),
                 "--url", url, "--seed", "1"]) == 0
    assert distance_to_blue(np.asarray(Image.open(out).convert("RGB"))) < 0.6 * distance_to_blue(
        np.asarray(Image.open(source).convert("RGB")))
    streamed, previews = tmp_path / "streamed.png", tmp_path / "previews"
    assert main(["edit", str(source), "a blue square on a yellow background", "--strength", "0.7", "-o", str(streamed),
                 "--url", url, "--seed", "1", "--stream-previews", str(previews), "--extra",
                 '{"extra_body": {"partial_images": 1}}']) == 0
    assert np.array_equal(np.asarray(Image.open(streamed)), np.asarray(Image.open(out)))  # the same pixels
    assert [p.name for p in previews.iterdir()] == ["partial-0.png"]
    assert "images: 2/2" in capsys.readouterr().err
    assert main(["edit", str(source), "x", "--strength", "2", "-o", str(out), "--url", url]) == 1
    assert "error 400" in capsys.readouterr().err


def test_reference_editing_on_a_kontext_checkpoint(deploy):
    url = deploy({**TINY_ARGS, "model": {"name": "tiny-flux-kontext"}})
    client = openai_client(url)
    response = client.images.edit(image=("in.png", RED_CIRCLE), prompt="make it blue", extra_body={"seed": 5})
    assert "reference" in response.model_extra["ditserve"]["signature"]
    r = httpx.post(f"{url}/v1/images/edits", data={"prompt": "x"},
                   files={"image": ("a.png", RED_CIRCLE, "image/png"), "mask": ("m.png", right_half_mask(),
                                                                               "image/png")}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mask"


def test_image_to_video_through_the_sdk(deploy):
    url = deploy({"model": {"name": "tiny-wan-i2v"},
                  "limits": {"default_size": "64x48", "default_steps": 4, "default_num_frames": 5,
                             "max_frames": 9, "max_pixels": 96 * 96},
                  "replica": TINY_ARGS["replica"]})
    client = openai_client(url)
    job = client.videos.create(prompt="a red ball", input_reference=("first.png", RED_CIRCLE),
                               extra_body={"seed": 6})
    deadline = time.monotonic() + 120
    while job.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        job = client.videos.retrieve(job.id)
    assert job.status == "completed", job.error
    assert "image_to_video" in job.model_extra["ditserve"]["signature"]
    assert client.videos.download_content(job.id).read()[4:8] == b"ftyp"
    r = httpx.post(f"{url}/v1/videos", data={"prompt": "x"},
                   files={"input_reference": ("a.png", b"GIF89a...", "image/gif")}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"
    thumbnail = Image.open(io.BytesIO(client.videos.download_content(job.id, variant="thumbnail").read()))
    assert (thumbnail.format, thumbnail.size) == ("WEBP", (64, 48))
