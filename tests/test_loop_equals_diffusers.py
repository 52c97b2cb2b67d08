"""Our batched denoising loop equals diffusers' own FluxPipeline on tiny-flux (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.families import load_family
from pipeline.loop import denoise_batch
from pipeline.sampling import SamplingParams
from pipeline.tiny.flux import ensure_tiny_flux
from tests.helpers import flux_params as params

TOL = 1e-4  # max abs pixel difference, images in [0, 1]


@pytest.fixture(scope="module")
def flux():
    return load_family("flux", ensure_tiny_flux(), torch_dtype=torch.float32, device="cpu")


def reference(flux, p: SamplingParams) -> np.ndarray:
    return flux.pipe(
        prompt=p.prompt, negative_prompt=p.negative_prompt, true_cfg_scale=p.cfg_scale,
        height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
        guidance_scale=p.embedded_guidance_scale, num_images_per_prompt=p.n,
        generator=torch.Generator().manual_seed(p.seed), max_sequence_length=flux.max_sequence_length,
        output_type="np").images


def test_single_request_equals_flux_pipeline(flux):
    p = params("a red circle on a blue background", 7)
    ours = denoise_batch(flux, [p]).images[0]
    ref = reference(flux, p)
    assert ours.shape == ref.shape == (1, 48, 64, 3)
    assert np.abs(ours - ref).max() <= TOL


def test_true_cfg_equals_flux_pipeline(flux):
    p = params("a green star", 11, negative="a blurry picture", true_cfg_scale=4.0)
    ours = denoise_batch(flux, [p]).images[0]
    assert np.abs(ours - reference(flux, p)).max() <= TOL


def test_batch_of_requests_equals_each_reference(flux):
    # Per-request prompt, negative prompt and seed; n=2 draws two samples from one generator.
    batch = [
        params("a red circle", 1, negative="blue", true_cfg_scale=3.0, n=2),
        params("yellow triangle on a black background at night", 2, negative="", true_cfg_scale=3.0),
        params("x", 3, negative="a very long negative prompt with many many words in it", true_cfg_scale=3.0),
    ]
    out = denoise_batch(flux, batch)
    for p, ours in zip(batch, out.images, strict=True):
        ref = reference(flux, p)
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= TOL, p.prompt
    assert out.steps == 6


def test_guidance_scale_changes_output(flux):
    a = denoise_batch(flux, [params("a red circle", 5, guidance=1.0)]).images[0]
    b = denoise_batch(flux, [params("a red circle", 5, guidance=6.0)]).images[0]
    assert np.abs(a - b).max() > 1e-3


def test_mixed_signatures_are_refused(flux):
    with pytest.raises(ValueError, match="mixes signatures"):
        denoise_batch(flux, [params("a", 1, steps=4), params("b", 2, steps=5)])
