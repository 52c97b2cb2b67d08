"""OpenAI's image streaming: previews decoded from the x0-prediction, Server-Sent Events through
real Ray Serve and the OpenAI SDK, and the handle's generate_stream."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from openai import BadRequestError, InternalServerError
from ray import serve

from pipeline.errors import RequestTimeoutError
from pipeline.loop import preview_steps
from pipeline.runner import BatchRunner
from tests.helpers import TINY_ARGS, batch_of, flux_params, openai_client, pixels, post


def test_preview_steps_are_evenly_spaced_before_the_end():
    assert preview_steps(16, 2) == [5, 11]
    assert preview_steps(16, 3) == [4, 8, 12]
    assert preview_steps(2, 3) == [1]  # short runs make fewer previews
    assert preview_steps(16, 0) == [] and preview_steps(1, 3) == []
    assert preview_steps(3, 3) == [1, 2]  # one per step boundary before the last
    for steps in range(1, 60):
        for partial_images in range(4):
            assert len(preview_steps(steps, partial_images)) == min(partial_images, steps - 1)


def test_previews_only_for_requests_that_ask_and_change_nothing_else():
    runner = BatchRunner("tiny-flux")
    streamed = flux_params("a red circle on a blue background", 1, steps=8, size=(64, 64), partial_images=3)
    plain = flux_params("a green star on a white background", 2, steps=8, size=(64, 64))
    events = []
    outputs = runner.run(batch_of(streamed, plain), on_preview=events.append)
    assert [(e["request_id"], e["partial_image_index"]) for e in events] == [("r1", 0), ("r1", 1), ("r1", 2)]
    alone = runner.run(batch_of(streamed, plain))  # the same batch without anyone listening
    for a, b in zip(outputs, alone, strict=True):
        assert a.images == b.images
    final = pixels(outputs[0].images[0]).astype(float)
    errors = [np.abs(pixels(e["images"][0]) - final).mean() for e in events]
    assert errors[-1] < errors[0]  # later previews are closer to the final image


@pytest.fixture(scope="module")
def url(deploy):
    return deploy(TINY_ARGS)


@pytest.fixture(scope="module")
def client(url):
    return openai_client(url)


BODY = {"seed": 3, "num_inference_steps": 6}


@pytest.mark.slow
def test_openai_sdk_iterates_the_stream(client):
    stream = client.images.generate(prompt="a red circle on a blue background", size="64x64", stream=True,
                                    partial_images=2, extra_body=BODY)
    events = list(stream)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(e.size == "64x64" and e.output_format == "png" for e in events)
    meta = events[-1].model_extra["ditserve"]
    assert meta["seed"] == 3 and meta["batch_size"] >= 1
    plain = client.images.generate(prompt="a red circle on a blue background", size="64x64",
                                   response_format="b64_json", extra_body=BODY)
    final = pixels(events[-1].b64_json).astype(int)
    assert np.abs(final - pixels(plain.data[0].b64_json)).max() <= 1  # the same image as without streaming


@pytest.mark.slow
def test_handle_generate_stream(url):
    handle = serve.get_app_handle("ditserve").options(stream=True)
    events = list(handle.generate_stream.remote({"prompt": "a green square", "size": "64x64", "stream": True,
                                                 "partial_images": 1, **BODY}))
    assert [e["type"] for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    assert events[-1]["ditserve"]["request_id"]


@pytest.mark.slow
@pytest.mark.parametrize("fields, param", [({"stream": True, "partial_images": 4}, "partial_images"),
                                           ({"partial_images": 2}, "partial_images"),
                                           ({"stream": True, "n": 2}, "stream"),
                                           ({"stream": "yes"}, "stream")])
def test_bad_streaming_fields_are_400_before_any_event(url, client, fields, param):
    response = post(url, {"prompt": "a", **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    with pytest.raises(BadRequestError):
        client.images.generate(prompt="a", extra_body=fields)


@pytest.mark.slow
def test_stream_given_in_extra_body_streams(url):
    """``stream`` nested in ``extra_body`` streams as a top-level one does (the route decides
    after validation merged them; it was a 400 'answered by generate_stream')."""
    body = {"prompt": "a red circle", "size": "64x64", **BODY, "extra_body": {"stream": True, "partial_images": 1}}
    with httpx.stream("POST", f"{url}/v1/images/generations", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        kinds = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert kinds == ["image_generation.partial_image", "image_generation.completed"]


@pytest.mark.slow
def test_a_failure_before_the_first_event_is_the_json_envelope_with_its_status(url, client):
    """A request that fails before its first event (here ``timeout_s`` passes before any
    preview) is answered as without streaming: the envelope and its HTTP status, not an SSE
    ``error`` event in a 200; the handle's ``generate_stream`` raises it."""
    body = {"prompt": "a slow one", "size": "256x256", "num_inference_steps": 60, "stream": True,
            "partial_images": 1, "timeout_s": 0.001}
    response = post(url, body)
    assert response.status_code == 504 and response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["code"] == "timeout", response.text
    with pytest.raises(InternalServerError) as raised:  # the SDK's class for every 5xx
        list(client.images.generate(prompt="a slow one", stream=True, partial_images=1, size="256x256",
                                    extra_body={"timeout_s": 0.001, "num_inference_steps": 60}))
    assert raised.value.status_code == 504
    handle = serve.get_app_handle("ditserve").options(stream=True)
    with pytest.raises(RequestTimeoutError):
        list(handle.generate_stream.remote(body))


@pytest.mark.slow
def test_a_client_leaving_mid_stream_stops_its_batch(url):
    import httpx

    from tests.helpers import router_stats, wait_until

    before = router_stats(url)["counters"]
    # 100 steps (~4 s here; it stops at the first preview): 60 steps lasted 2.5 s, the client left 0.7 s in
    body = {"prompt": "a long one", "size": "256x256", "num_inference_steps": 100, "stream": True,
            "partial_images": 3, "seed": 1}
    with httpx.stream("POST", f"{url}/v1/images/generations", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: image_generation.partial_image"):
                break  # one preview seen: leave
    wait_until(lambda: router_stats(url)["counters"].get("cancelled_running", 0) > before.get("cancelled_running", 0),
               timeout=60)
    assert router_stats(url)["counters"]["steps_saved"] > before.get("steps_saved", 0)  # this batch's


@pytest.mark.slow
def test_cli_streams_and_saves_previews(url, tmp_path, capsys):
    from PIL import Image

    from deployments.cli import main

    out, previews = tmp_path / "circle.png", tmp_path / "previews"
    assert main(["generate", "a red circle", "-o", str(out), "--url", url, "--size", "64x64", "--steps", "8",
                 "--stream-previews", str(previews)]) == 0
    assert Image.open(out).size == (64, 64)
    assert sorted(p.name for p in previews.iterdir()) == ["partial-0.png", "partial-1.png", "partial-2.png"]
    assert "images: 4/4" in capsys.readouterr().err  # the progress bar saw every event: 3 previews, the image
    # 2 steps give one preview: the bar ends full (it stayed at 2/4)
    assert main(["generate", "a red circle", "-o", str(out), "--url", url, "--size", "64x64", "--steps", "2",
                 "--stream-previews", str(tmp_path / "few")]) == 0
    assert sorted(p.name for p in (tmp_path / "few").iterdir()) == ["partial-0.png"]
    assert "images: 2/2" in capsys.readouterr().err
    # into the first run's directory: its previews go (partial-1, -2 stayed beside the new -0),
    # other files stay
    (previews / "notes.txt").write_text("mine")
    (previews / "partial-0.jpg").write_bytes(b"an older run's jpeg")
    (previews / "partial-1.JPG").write_bytes(b"one from -o x.JPG")  # helper-78: it stayed
    assert main(["generate", "a red circle", "-o", str(out), "--url", url, "--size", "64x64", "--steps", "2",
                 "--stream-previews", str(previews)]) == 0
    assert sorted(p.name for p in previews.iterdir()) == ["notes.txt", "partial-0.png"]
    # -o's suffix in any case picks the format; the previews' suffix is its lower case
    assert main(["generate", "a red circle", "-o", str(tmp_path / "c.WebP"), "--url", url, "--size", "64x64",
                 "--steps", "2", "--stream-previews", str(previews)]) == 0
    assert sorted(p.name for p in previews.iterdir()) == ["notes.txt", "partial-0.webp"]
    assert Image.open(previews / "partial-0.webp").format == "WEBP"
