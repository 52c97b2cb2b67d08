"""A request's output does not depend on what it was batched with (fp32 CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.families import load_family
from pipeline.loop import denoise_batch
from pipeline.tiny.flux import ensure_tiny_flux
from tests.helpers import flux_params as params

TOL = 1e-5


@pytest.fixture(scope="module")
def flux():
    return load_family("flux", ensure_tiny_flux(), torch_dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("cfg", [1.0, 4.0], ids=["no-cfg", "true-cfg"])
def test_alone_equals_inside_a_batch_of_four(flux, cfg):
    target = params("a red circle", 123, negative="blurry", true_cfg_scale=cfg)
    others = [
        params("a tiny green star on a white background at night with a big moon", 7,
               negative="x", true_cfg_scale=cfg),
        params("b", 8, negative="a long negative prompt about bad drawings of trees", true_cfg_scale=cfg, n=2),
        params("yellow triangle", 9, negative="", true_cfg_scale=cfg),
    ]
    alone = denoise_batch(flux, [target]).images[0]
    for position in range(4):
        batch = others[:position] + [target] + others[position:]
        inside = denoise_batch(flux, batch).images[position]
        diff = np.abs(alone - inside).max()
        assert diff <= TOL, f"position {position}: max abs diff {diff}"


def test_each_request_of_a_batch_gets_its_own_output_format():
    """``output_format`` is not in the signature: a batch mixes formats, each request encoded
    its own way after the shared denoise, its pixels those of its PNG (within JPEG/WebP loss)."""
    import io

    from PIL import Image

    from pipeline.runner import BatchRunner
    from pipeline.signature import BatchSignature
    from tests.helpers import batch_of, pixels

    formats = [("png", None, "PNG"), ("jpeg", 90, "JPEG"), ("webp", 90, "WEBP"), ("jpeg", 5, "JPEG")]
    mean_levels = [0, 12, 12, 40]  # mean |pixel - the PNG's| each may have (0-255)
    requests = [params("a red circle", 3, output_format=f, output_compression=c) for f, c, _ in formats]
    assert len({BatchSignature.of(p) for p in requests}) == 1
    runner = BatchRunner("tiny-flux")
    outputs = runner.run(batch_of(*requests))
    reference = pixels(outputs[0].images[0])
    for (_, _, pillow), bound, out in zip(formats, mean_levels, outputs, strict=True):
        image = Image.open(io.BytesIO(out.images[0]))
        assert image.format == pillow and image.size == (64, 48)
        assert np.abs(pixels(out.images[0]) - reference).mean() <= bound
    assert len(outputs[3].images[0]) < len(outputs[1].images[0])  # lower quality, fewer bytes


def test_cache_dit_decides_for_the_whole_batch():
    """The documented exception: cache-dit takes one caching decision per transformer call
    over the batch's rows (its statistic is their mean), so Cache-DiT requests batched together
    report the same ``cached_steps``, and one may differ from its run alone (helper-51: up to
    115/255 on tiny-flux). Alone, a Cache-DiT request is reproducible, and an exact request
    batched after a Cache-DiT batch is unchanged (no cache state carried over)."""
    import dataclasses

    from pipeline.cache_dit_params import CacheDiTParams
    from pipeline.runner import BatchRunner
    from tests.helpers import batch_of, pixels

    knobs = CacheDiTParams(residual_diff_threshold=0.3, max_warmup_steps=1)
    cached = [dataclasses.replace(params(f"shape {i}", i * 11 + 1, steps=10, size=(64, 64)), request_id=f"c{i}",
                                  enable_cache_dit=True, cache_dit_params=knobs) for i in range(4)]
    runner = BatchRunner("tiny-flux")
    exact = params("a red circle", 5, steps=10, size=(64, 64))
    before = runner.run(batch_of(exact))[0].images
    alone = [runner.run(batch_of(p))[0] for p in cached]
    together = runner.run(batch_of(*cached))
    assert len({out.acceleration.cache_dit.cached_steps for out in together}) == 1  # one decision per call
    assert all(out.acceleration.cache_dit.cached_steps > 0 for out in together)
    again = runner.run(batch_of(cached[2]))[0]
    assert again.images == alone[2].images  # reproducible alone
    assert runner.run(batch_of(exact))[0].images == before
    assert any(not np.array_equal(pixels(a.images[0]), pixels(t.images[0]))
               for a, t in zip(alone, together, strict=True))  # what its batch-mates decided


def test_values_that_run_alike_batch_together_each_as_alone():
    """Requests whose signatures are equal only by what they run (cfg_gate_step 0.1 and 0.2 of
    6 steps; strength 0.6 and 0.55 of 8) share a batch, and each gets the image it gets alone,
    with its own ``cfg_gate_step`` reported."""
    import dataclasses

    from pipeline.modes import InputMode
    from pipeline.runner import BatchRunner
    from pipeline.signature import BatchSignature
    from pipeline.wire import ImageArray
    from tests.helpers import batch_of, pixels

    runner = BatchRunner("tiny-flux")
    gated = [dataclasses.replace(params(f"shape {g}", i + 1, negative="blurry", true_cfg_scale=4.0),
                                 cfg_gate_fraction=g) for i, g in enumerate((0.1, 0.2))]
    image = ImageArray(64, 48, 3, np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8).tobytes())
    edits = [params("a blue square", 5 + i, steps=8, input_mode=InputMode.IMAGE_TO_IMAGE, strength=s,
                    num_input_images=1, images=(image,)) for i, s in enumerate((0.6, 0.55))]
    for pair in (gated, edits):
        pair = [dataclasses.replace(p, request_id=f"{p.request_id}-{i}") for i, p in enumerate(pair)]
        assert BatchSignature.of(pair[0]) == BatchSignature.of(pair[1])
        together = runner.run(batch_of(*pair))
        for p, out in zip(pair, together, strict=True):
            alone = runner.run(batch_of(p))[0]
            assert np.abs(pixels(out.images[0]) - pixels(alone.images[0])).max() <= 1  # the pre-rounding tolerance
            assert out.acceleration.cfg_gate.gate_step == p.cfg_gate_fraction
            assert out.acceleration.cfg_gate.reused_steps == (5 if p.guided else 0)  # gated after step 1 of 6


def test_a_non_finite_output_fails_its_request_alone(monkeypatch):
    """A request whose decoded output holds NaN (fp16 overflow, a broken adapter) gets a 500
    naming it; encoded as it was, NaN became black pixels answered 200 (helper-63). Its
    batch-mates keep their images."""
    from pipeline.runner import BatchRunner
    from tests.helpers import batch_of, pixels

    runner = BatchRunner("tiny-flux")
    requests = [params("a red circle", 3), params("a blue square", 4), params("a green star", 5)]
    fine = runner.run(batch_of(*requests))
    decode = runner.family.decode

    def poisoned(*args, **kwargs):
        images = decode(*args, **kwargs)
        images[1][0, 0, 0] = np.nan  # one value of the second request's image
        return images

    monkeypatch.setattr(runner.family, "decode", poisoned)
    outputs = runner.run(batch_of(*requests))
    error = outputs[1].error
    assert error is not None and error.code == "non_finite_output" and outputs[1].images == []
    assert requests[1].request_id in error.message and error.to_envelope()["error"]["type"] == "server_error"
    for i in (0, 2):
        assert outputs[i].error is None and np.array_equal(pixels(outputs[i].images[0]), pixels(fine[i].images[0]))


def test_an_overflowed_request_streams_no_previews_and_fails_alone(monkeypatch):
    """Latents that overflow to +inf: the VAE's post-processing clamps +inf to white, so the
    decoded-output check alone answered a white image with 200 (helper-65), and the previews
    of such a request streamed black or white frames. The final latents are checked per
    request, previews of non-finite predictions are not sent, and batch-mates are unaffected."""
    from pipeline.runner import BatchRunner
    from tests.helpers import batch_of, pixels

    runner = BatchRunner("tiny-flux")
    requests = [params(p, s, partial_images=2) for p, s in
                (("a red circle", 3), ("a blue square", 4), ("a green star", 5))]
    fine_previews: list[dict] = []
    fine = runner.run(batch_of(*requests), on_preview=fine_previews.append)
    after_step = runner.family.after_step

    def overflowed(latents, *args, **kwargs):
        latents = after_step(latents, *args, **kwargs).clone()
        latents[1, 0, 0] = float("inf")  # one value of the second request's latents, from the first step on
        return latents

    monkeypatch.setattr(runner.family, "after_step", overflowed)
    previews: list[dict] = []
    outputs = runner.run(batch_of(*requests), on_preview=previews.append)
    error = outputs[1].error
    assert error is not None and error.code == "non_finite_output" and outputs[1].images == []
    assert {e["request_id"] for e in previews} == {requests[0].request_id, requests[2].request_id}
    assert previews == [e for e in fine_previews if e["request_id"] != requests[1].request_id]
    for i in (0, 2):
        assert outputs[i].error is None and np.array_equal(pixels(outputs[i].images[0]), pixels(fine[i].images[0]))


def test_an_output_its_encoder_cannot_write_fails_its_request_alone():
    """A WebP side past 16383 pixels failed its whole batch after the denoise: PNG batch-mates
    and their streamed previews too, and the SDK retried it twice (helper-70). The contract
    refuses such a size (tests/test_contract.py); an encoding failure past it fails its own
    request, a 500 ``encoding_failed`` that says not to retry, with no previews."""
    import io

    from PIL import Image

    from deployments.http import error_response
    from pipeline.runner import BatchRunner
    from tests.helpers import batch_of

    runner = BatchRunner("tiny-flux")
    tall = {"size": (16, 16400), "steps": 2, "partial_images": 1}
    requests = [params("a red circle", 3, **tall), params("a blue square", 4, output_format="webp", **tall)]
    previews: list[dict] = []
    outputs = runner.run(batch_of(*requests), on_preview=previews.append)
    assert outputs[0].error is None and Image.open(io.BytesIO(outputs[0].images[0])).size == (16, 16400)
    error = outputs[1].error
    assert error is not None and error.code == "encoding_failed" and outputs[1].images == []
    assert "as webp at 16x16400 (ValueError)" in error.message and requests[1].request_id in error.message
    assert error_response(error).headers["x-should-retry"] == "false"
    assert [e["request_id"] for e in previews] == [requests[0].request_id]


def test_a_video_whose_thumbnail_cannot_be_encoded_fails_alone(monkeypatch):
    """A video whose MP4 encoded and whose WebP thumbnail then failed was listed twice, and the
    whole batch failed on the mismatch (helper-73): it fails alone, its batch-mate keeps its
    MP4 and thumbnail."""
    import io

    from PIL import Image

    import pipeline.runner as runner_module
    from pipeline.runner import BatchRunner
    from tests.helpers import batch_of, video_params

    runner = BatchRunner("tiny-wan")
    requests = [video_params(runner.family, prompt, seed, num_inference_steps=2, num_frames=5)
                for prompt, seed in (("a red circle", 1), ("a blue square", 2))]
    encode, calls = runner_module.encode_image, []

    def first_fails(image, output_format="png", output_compression=None):
        calls.append(output_format)
        if len(calls) == 1:  # the first request's thumbnail: its MP4 was encoded before it
            raise ValueError("injected")
        return encode(image, output_format, output_compression)

    monkeypatch.setattr(runner_module, "encode_image", first_fails)
    outputs = runner.run(batch_of(*requests))
    assert calls == ["webp", "webp"]
    error = outputs[0].error
    assert error is not None and error.code == "encoding_failed" and outputs[0].videos == []
    assert "an MP4 with a webp thumbnail at 64x48 (ValueError)" in error.message
    assert outputs[1].error is None and outputs[1].videos[0][4:8] == b"ftyp"
    assert Image.open(io.BytesIO(outputs[1].images[0])).size == (64, 48)
