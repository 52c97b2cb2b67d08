"""Image inputs on the batched loop: each mode equals its diffusers pipeline, batches equal
requests run alone, Cache-DiT follows the steps that run, 2 ranks equal 1 rank."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import ray
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline
from PIL import Image, ImageDraw

from pipeline.cache_dit_params import CacheDiTParams
from pipeline.contract.edits import effective_steps
from pipeline.families import load_family
from pipeline.families.base import pixel_tensor
from pipeline.loop import denoise_batch, plan_batch
from pipeline.modes import InputMode
from pipeline.runner import BatchRunner
from pipeline.tiny.data import COLORS, Scene, draw
from pipeline.tiny.registry import resolve_checkpoint
from pipeline.wire import ImageArray
from tests.helpers import batch_of, flux_params, rank_workers, video_params

TOL = 1e-4  # max abs pixel difference, images in [0, 1]
# Sharded attention sums in another order; true CFG (scale 3) amplifies that float32 noise to
# ~2e-4 at a few pixels (mean ~1e-5).
SP_TOL = 5e-4


def scene(color: str, shape: str, background: str, seed: int = 0) -> Image.Image:
    return draw(Scene(color, shape, background), random.Random(seed))


def as_array(image: Image.Image) -> ImageArray:
    return ImageArray(image.width, image.height, len(image.getbands()), image.tobytes())


def half_mask(width: int, height: int) -> Image.Image:
    """OpenAI's mask convention: alpha 0 (transparent) on the right half = repaint it."""
    alpha = Image.new("L", (width, height), 255)
    ImageDraw.Draw(alpha).rectangle((width // 2, 0, width - 1, height - 1), fill=0)
    return alpha


def edit(prompt, seed, image: Image.Image, mode=InputMode.IMAGE_TO_IMAGE, strength=0.7, mask=None, **fields):
    return flux_params(prompt, seed, size=image.size, input_mode=mode, strength=strength, num_input_images=1,
                       images=(as_array(image),), mask=None if mask is None else as_array(mask), **fields)


@pytest.fixture(scope="module")
def flux():
    return load_family("flux", resolve_checkpoint("tiny-flux", None), torch_dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def kontext():
    return load_family("flux-kontext", resolve_checkpoint("tiny-flux-kontext", None), torch_dtype=torch.float32,
                       device="cpu")


def diffusers_edit(pipe, p, image, **extra) -> np.ndarray:
    max_sequence_length = min(512, pipe.tokenizer_2.model_max_length)  # as FluxFamily encodes
    return pipe(prompt=p.prompt, negative_prompt=p.negative_prompt, true_cfg_scale=p.cfg_scale, image=image,
                height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                guidance_scale=p.embedded_guidance_scale, num_images_per_prompt=p.n,
                generator=torch.Generator().manual_seed(p.seed), max_sequence_length=max_sequence_length, output_type="np",
                **extra).images


def test_image_to_image_equals_flux_img2img_pipeline(flux):
    image = scene("red", "circle", "yellow")
    p = edit("a blue square on a yellow background", 3, image, strength=0.7, n=2, steps=8,
             negative="blurry", true_cfg_scale=3.0)
    ours = denoise_batch(flux, [p])
    ref = diffusers_edit(FluxImg2ImgPipeline.from_pipe(flux.pipe), p, image, strength=0.7)
    assert ours.steps == effective_steps(8, 0.7) == 6
    assert ours.images[0].shape == ref.shape == (2, 64, 64, 3)
    assert np.abs(ours.images[0] - ref).max() <= TOL


def test_inpainting_equals_flux_inpaint_pipeline(flux):
    image, mask = scene("green", "square", "black"), half_mask(64, 64)
    p = edit("a red star on a black background", 5, image, mode=InputMode.INPAINT, strength=0.9, mask=mask, steps=8)
    ours = denoise_batch(flux, [p]).images[0]
    repaint = Image.eval(mask, lambda a: 255 - a)  # diffusers' mask: white is repainted
    ref = diffusers_edit(FluxInpaintPipeline.from_pipe(flux.pipe), p, image, mask_image=repaint, strength=0.9)
    assert np.abs(ours - ref).max() <= TOL


def test_reference_editing_equals_flux_kontext_pipeline(kontext):
    image = scene("blue", "triangle", "white")
    p = flux_params("make it red", 9, size=(64, 64), steps=6, n=2, input_mode=InputMode.REFERENCE,
                    num_input_images=1, images=(as_array(image),))
    ours = denoise_batch(kontext, [p]).images[0]
    ref = diffusers_edit(kontext.pipe, p, image, _auto_resize=False, max_area=64 * 64)
    assert np.abs(ours - ref).max() <= TOL


def test_image_to_video_equals_wan_image_to_video_pipeline():
    wan = load_family("wan", resolve_checkpoint("tiny-wan-i2v", None), torch_dtype=torch.float32, device="cpu")
    assert type(wan.pipe).__name__ == "WanImageToVideoPipeline" and wan.input_modes == (InputMode.IMAGE_TO_VIDEO,)
    image = scene("red", "circle", "yellow").resize((64, 48))
    p = dataclasses.replace(video_params(wan, "a red ball rolling", 5, negative_prompt="blurry", guidance_scale=5.0),
                            input_mode=InputMode.IMAGE_TO_VIDEO, num_input_images=1, images=(as_array(image),))
    ours = denoise_batch(wan, [p]).images[0]
    ref = wan.pipe(image=image, prompt=p.prompt, negative_prompt=p.negative_prompt, height=48, width=64,
                   num_frames=p.num_frames, num_inference_steps=p.num_inference_steps, guidance_scale=5.0,
                   generator=torch.Generator().manual_seed(5), output_type="np",
                   max_sequence_length=wan.max_sequence_length).frames
    assert ours.shape == ref.shape == (1, 9, 48, 64, 3)
    assert np.abs(ours - ref).max() <= TOL


def test_a_batch_of_edits_equals_each_run_alone(flux):
    """Different input images, masks, prompts and seeds in one batch; the images are per request."""
    images = [scene("red", "circle", "yellow"), scene("green", "star", "blue", 1), scene("white", "square", "red", 2)]
    alone = [edit(f"prompt {i}", i, im, steps=6, strength=0.5) for i, im in enumerate(images)]
    batched = denoise_batch(flux, alone).images
    for p, ours in zip(alone, batched, strict=True):
        assert np.abs(ours - denoise_batch(flux, [p]).images[0]).max() <= TOL
    masks = [half_mask(64, 64), Image.new("L", (64, 64), 0)]
    inpaint = [edit(f"p{i}", i, images[i], mode=InputMode.INPAINT, strength=1.0, mask=m, steps=6)
               for i, m in enumerate(masks)]
    for p, ours in zip(inpaint, denoise_batch(flux, inpaint).images, strict=True):
        assert np.abs(ours - denoise_batch(flux, [p]).images[0]).max() <= TOL


def test_inpainting_keeps_the_unmasked_half_within_vae_round_trip_error(flux):
    image = scene("red", "circle", "yellow")
    p = edit("a blue square on a yellow background", 1, image, mode=InputMode.INPAINT, strength=1.0,
             mask=half_mask(64, 64), steps=16)
    out = denoise_batch(flux, [p]).images[0][0]
    x = np.asarray(image, dtype=np.float32) / 255.0
    vae = flux.pipe.vae
    with torch.no_grad():
        latents = vae.encode(pixel_tensor([as_array(image)], "cpu", torch.float32)).latent_dist.mode()
        round_trip = flux.pipe.image_processor.postprocess(vae.decode(latents).sample, output_type="np")[0]
    kept = slice(0, 28)  # the unmasked half, away from the decoder's reach across the seam
    round_trip_error = np.abs(round_trip[:, kept] - x[:, kept]).mean()
    kept_error = np.abs(out[:, kept] - x[:, kept]).mean()
    assert kept_error <= 1.25 * round_trip_error
    assert np.abs(out[:, 36:] - x[:, 36:]).mean() > 2.5 * kept_error  # the masked half was repainted


def test_an_inpainting_preview_keeps_the_unmasked_region_as_the_final_image_does(flux):
    """helper-78: previews decoded the x0-prediction everywhere, so the half the mask keeps
    showed a scene being repainted there too; it is now the input image, as after the last step."""
    image = scene("red", "circle", "yellow")
    p = edit("a blue square on a yellow background", 4, image, mode=InputMode.INPAINT, strength=1.0,
             mask=half_mask(64, 64), steps=16, partial_images=3)
    previews = []
    final = denoise_batch(flux, [p], on_preview=lambda i, k, images: previews.append(images[0])).images[0][0]
    assert len(previews) == 3
    kept = slice(0, 28)  # the unmasked half, away from the decoder's reach across the seam
    for preview in previews:
        # measured: 1.9, 0.8, 0.4 levels (22.5, 7.0, 3.3 before); the decoder reaches across latents
        assert np.abs(preview[:, kept] - final[:, kept]).mean() <= 2.5 / 255
    assert np.abs(previews[0][:, 36:] - final[:, 36:]).mean() > 4 / 255  # the repainted half is on its way


def test_image_to_image_with_the_embedded_model_moves_toward_the_prompt(flux):
    """A drawn red circle, edited toward "a blue square": its foreground colour gets bluer."""
    image = scene("red", "circle", "yellow")
    blue = np.array(COLORS["blue"], dtype=np.float64)

    def distance_to_blue(pixels: np.ndarray) -> float:
        x = pixels.astype(np.float64)
        border = np.concatenate([x[0], x[-1], x[:, 0], x[:, -1]])
        foreground = np.sqrt(((x - np.median(border, axis=0)) ** 2).sum(-1)) > 60
        return float(np.sqrt(((np.median(x[foreground], axis=0) - blue) ** 2).sum()))

    before = distance_to_blue(np.asarray(image))
    for seed in range(3):
        p = edit("a blue square on a yellow background", seed, image, strength=0.7, steps=16)
        out = (denoise_batch(flux, [p]).images[0][0] * 255).round().astype(np.uint8)
        assert distance_to_blue(out) < 0.6 * before, seed


def test_previews_of_a_shortened_run_use_the_sigmas_it_runs(flux):
    """strength 0.5 of 8 steps starts at the 5th sigma: the x0-prediction of its first step uses
    that sigma, not the first one of a full run."""
    from pipeline.loop import x0_prediction

    p = edit("a blue square", 2, scene("red", "circle", "yellow"), strength=0.5, steps=8)
    schedule = plan_batch(flux, p)
    latents, velocity = torch.ones(1, 4, 2), torch.ones(1, 4, 2)
    start = schedule.scheduler.begin_index
    assert start == 4
    expected = latents - schedule.scheduler.sigmas[start] * velocity
    assert torch.equal(x0_prediction(schedule.scheduler, latents, velocity, 0), expected)


def test_strength_runs_fewer_steps_and_cache_dit_is_sized_for_them():
    """strength 0.5 of 8 steps runs 4: the schedule, the Cache-DiT context (an SCM mask over
    exactly those 4 steps) and the report all follow the steps that run."""
    runner = BatchRunner("tiny-flux")
    image = scene("red", "circle", "yellow")
    knobs = CacheDiTParams(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1,
                           scm_compute_bins=[1, 1], scm_cache_bins=[1, 1], residual_diff_threshold=10.0)
    p = dataclasses.replace(edit("a blue square", 2, image, strength=0.5, steps=8), enable_cache_dit=True,
                            cache_dit_params=knobs)
    assert p.effective_steps == 4 and len(plan_batch(runner.family, p).timesteps) == 4
    out = runner.run(batch_of(p))[0]
    cache = out.acceleration.cache_dit
    assert cache.active and cache.cached_steps + cache.computed_steps == 4
    assert cache.cached_steps == 2  # the mask's two cache bins over the 4 steps that ran
    exact = BatchRunner("tiny-flux").run(batch_of(dataclasses.replace(p, enable_cache_dit=False,
                                                                      cache_dit_params=None)))[0]
    assert exact.acceleration.cache_dit.computed_steps == 4


# -- sequence parallelism: 2 ranks equal 1 rank for every mode -----------------------------------
def _ranks(model: str, degree: int = 2):
    return rank_workers({"ulysses_degree": degree, "ring_degree": 1}, model)


def _two_ranks_equal_one(model: str, batch_params):
    batch = batch_of(*batch_params)
    single = BatchRunner(model).denoise(batch)
    workers = _ranks(model)
    try:
        sharded = ray.get([w.denoise.remote(batch) for w in workers], timeout=300)[0]
        for a, b in zip(single.images, sharded.images, strict=True):
            assert np.abs(a - b).max() <= SP_TOL and np.abs(a - b).mean() <= 5e-5
    finally:
        for w in workers:
            ray.kill(w)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_for_image_to_image_and_inpainting(ray_cluster):
    image, other = scene("red", "circle", "yellow"), scene("green", "star", "blue", 1)
    cfg = dict(negative="blurry", true_cfg_scale=3.0, steps=6)
    _two_ranks_equal_one("tiny-flux", (edit("a blue square", 1, image, strength=0.6, **cfg),
                                       edit("a red star", 2, other, strength=0.6, **cfg)))
    _two_ranks_equal_one("tiny-flux", (edit("a blue square", 3, image, mode=InputMode.INPAINT, strength=1.0,
                                            mask=half_mask(64, 64), steps=6),))


@pytest.mark.slow
def test_two_ranks_equal_one_rank_for_reference_editing(ray_cluster):
    """The reference tokens are split across the ranks with the sample's."""
    images = [scene("blue", "triangle", "white"), scene("red", "square", "green", 3)]
    _two_ranks_equal_one("tiny-flux-kontext", tuple(
        flux_params(f"edit {i}", i, size=(64, 64), steps=6, input_mode=InputMode.REFERENCE, num_input_images=1,
                    images=(as_array(im),)) for i, im in enumerate(images)))


@pytest.mark.slow
def test_two_ranks_equal_one_rank_for_image_to_video(ray_cluster):
    """The per-token timesteps (0 on the conditioned first frame) are split with the tokens."""
    runner = BatchRunner("tiny-wan-i2v")
    image = as_array(scene("red", "circle", "yellow").resize((64, 64)))
    batch = tuple(dataclasses.replace(video_params(runner.family, f"clip {i}", i, size="64x64", guidance_scale=4.0,
                                                   negative_prompt="blurry", num_inference_steps=4),
                                      input_mode=InputMode.IMAGE_TO_VIDEO, num_input_images=1, images=(image,))
                  for i in range(2))
    _two_ranks_equal_one("tiny-wan-i2v", batch)
