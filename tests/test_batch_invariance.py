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
