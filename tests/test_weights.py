"""Weights that fit and decodes that fit: ``model.offload`` (pipeline.offload) and
``model.vae`` tiling / slicing, each against the plain run (CPU, fixed seeds)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from deployments.config import AppConfig
from pipeline.cache_dit_params import CacheDiTParams
from pipeline.modes import offload_problems
from pipeline.runner import BatchRunner
from tests.helpers import batch_of
from tests.helpers import flux_params as params
from tests.helpers import video_params


def test_offload_is_refused_where_it_cannot_work():
    assert "needs a model with boundary experts" in offload_problems("idle_expert", boundary_experts=False,
                                                                     torch_compile=False)[0]
    assert offload_problems("group", boundary_experts=False, torch_compile=False) == []
    with pytest.raises(ValueError, match="model.offload='group' moves weights between steps"):
        AppConfig.model_validate({"model": {"offload": "group"}, "acceleration": {"torch_compile": True}})
    with pytest.raises(ValueError, match="model.offload"):
        AppConfig.model_validate({"model": {"offload": "everything"}})
    with pytest.raises(ValueError, match="needs a model with boundary experts"):
        BatchRunner("tiny-flux", offload="idle_expert")


@pytest.mark.parametrize(("model", "parallel", "problem"), [
    ({"name": "tiny-flux", "offload": "idle_expert"}, {}, "needs a model with boundary experts"),
    ({"name": "tiny-wan", "offload": "idle_expert"}, {}, "needs a model with boundary experts"),
    ({"name": "tiny-wan-moe", "offload": "idle_expert", "dual_transformer": "paired"}, {},
     "needs a model with boundary experts"),
    ({"name": "tiny-wan-paired"}, {"cfg_degree": 2, "shard_weights": True}, "cannot serve paired transformers"),
    ({"name": "tiny-wan-moe", "dual_transformer": "paired"}, {"cfg_degree": 2, "shard_weights": True},
     "cannot serve paired transformers"),
])
def test_weights_options_the_model_cannot_take_are_refused_by_the_config(model, parallel, problem):
    """helper-67: these passed ``--check`` and failed only where the replica started (33 s
    later), though the config tells how an embedded model, or ``model.dual_transformer``, runs
    its transformers. A checkpoint's own is still read where it loads."""
    with pytest.raises(ValueError, match=problem):
        AppConfig.model_validate({"model": model, "parallel": parallel})
    AppConfig.model_validate({"model": {"name": "tiny-wan-moe", "offload": "idle_expert"}})
    AppConfig.model_validate({"model": {"name": "tiny-wan-moe"}, "parallel": {"cfg_degree": 2, "shard_weights": True}})
    AppConfig.model_validate({"model": {"name": "wan", "path": "/checkpoints/wan", "offload": "idle_expert"}})


def test_idle_expert_offload_equals_no_offload():
    """Wan 2.2-style experts: only the running one is resident; it is swapped at the boundary
    (and back for the next batch), and the video is the same."""
    plain = BatchRunner("tiny-wan-moe")
    offloaded = BatchRunner("tiny-wan-moe", offload="idle_expert")
    fields = dict(guidance_scale=4.0, negative_prompt="blurry", num_inference_steps=4, size="64x64")
    batch = batch_of(video_params(plain.family, "a red circle", 3, **fields))
    a, b = plain.denoise(batch), offloaded.denoise(batch)
    assert set(a.calls) == {"transformer", "transformer_2"}
    assert np.array_equal(a.images[0], b.images[0])
    assert offloaded.counters()["offload_moves"] == 1  # transformer_2 moved in at the boundary
    offloaded.denoise(batch)
    assert offloaded.counters()["offload_moves"] == 3  # back to transformer, then transformer_2 again


def _group_offload_requests(name: str, family) -> list:
    """Plain, cached, plain, cached with other knobs, then cached again: mount, unmount, mount,
    remount and unmount again on the one runner."""
    knobs = CacheDiTParams(Fn_compute_blocks=1, max_warmup_steps=2, residual_diff_threshold=0.5)
    other = knobs.model_copy(update={"residual_diff_threshold": 0.3})
    if name == "tiny-flux":
        p = params("a red circle", 3, negative="blurry", true_cfg_scale=2.0, size=(64, 64), steps=6)
    else:
        p = video_params(family, "a red circle", 3, num_inference_steps=6)
    return [p, *(dataclasses.replace(p, enable_cache_dit=True, cache_dit_params=c) for c in (knobs, other)),
            p, dataclasses.replace(p, enable_cache_dit=True, cache_dit_params=knobs), p]


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan"])
def test_group_offload_equals_no_offload_also_with_cache_dit(name):
    """On Wan, diffusers' group-offload hooks make the transformer's ``forward`` a partial that
    cache-dit could not put back: every unmount and remount failed its batch (helper-67)."""
    plain = BatchRunner(name)
    grouped = BatchRunner(name, offload="group")
    for i, request in enumerate(_group_offload_requests(name, plain.family)):
        a, b = plain.denoise(batch_of(request)), grouped.denoise(batch_of(request))
        assert np.abs(a.images[0] - b.images[0]).max() <= 1e-6, i
    assert grouped.counters()["unmounts"] == plain.counters()["unmounts"] == 2
    assert grouped.counters()["remounts"] == 1


def test_vae_tiling_decodes_within_its_bound():
    """diffusers' tiled decode blends tiles at their seams: bounded difference from the whole
    decode (tile sizes made small so the tiny models' outputs have several tiles)."""
    for name, make in (("tiny-flux", lambda f: params("a red circle", 3, size=(128, 128), steps=2)),
                       ("tiny-wan", lambda f: video_params(f, "a red circle", 3, num_inference_steps=2,
                                                           size="128x128"))):
        whole, tiled = BatchRunner(name), BatchRunner(name, vae_tiling=True)
        vae = tiled.family.pipe.vae
        assert vae.use_tiling
        vae.tile_sample_min_height = vae.tile_sample_min_width = 64
        vae.tile_sample_stride_height = vae.tile_sample_stride_width = 48
        if hasattr(vae, "tile_latent_min_size"):  # AutoencoderKL (FLUX) sizes its tiles in latents too
            factor = 2 ** (len(vae.config.block_out_channels) - 1)
            vae.tile_sample_min_size, vae.tile_latent_min_size = 64, 64 // factor
        batch = batch_of(make(whole.family))
        a, b = whole.denoise(batch).images[0], tiled.denoise(batch).images[0]
        assert a.shape == b.shape
        diff = np.abs(a - b)
        assert 0 < diff.mean() <= 0.05 and diff.max() <= 0.6, name
