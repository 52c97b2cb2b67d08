"""CFG parallelism on CPU (``parallel.cfg``): real Ray rank actors, gloo, yunchang.

Each layout is built once per module and checked against one rank on guided and unguided
batches (rows split across the CFG groups, a lone image, the CFG gate) for FLUX and Wan.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import ray

from parallel.config import ParallelConfig
from pipeline.cache_dit_params import CacheDiTParams
from pipeline.runner import BatchRunner
from tests.helpers import batch_of, rank_workers
from tests.helpers import flux_params as params
from tests.helpers import video_params

pytestmark = pytest.mark.slow

GUIDED = dict(negative="blurry", true_cfg_scale=3.0, size=(64, 64), steps=4)
TOLERANCE = 1e-4  # float32 pixels in [0, 1]: the same forwards, gathered instead of run in turn


def _run(workers, batch):
    return ray.get([w.denoise.remote(batch) for w in workers], timeout=300)


def _close(single, parallel):
    for a, b in zip(single.images, parallel.images, strict=True):
        assert a.shape == b.shape and np.abs(a - b).max() <= TOLERANCE


@pytest.fixture(scope="module")
def flux_single():
    return BatchRunner("tiny-flux")


@pytest.fixture(scope="module", params=[{"cfg_degree": 2}, {"cfg_degree": 2, "ulysses_degree": 2}],
                ids=["cfg2", "cfg2xulysses2"])
def flux_cfg(request, ray_cluster):
    workers = rank_workers(request.param)
    yield workers
    for w in workers:
        ray.kill(w)


def test_layout_of_a_cfg_replica():
    config = ParallelConfig(ulysses_degree=2, cfg_degree=2)
    assert (config.world_size, config.sp_degree, config.sequence_layout().world_size) == (4, 2, 2)
    assert ParallelConfig(cfg_degree=3).startup_problems(num_heads=4) == [
        "parallel.cfg_degree must be 1 or 2 (the two branches of a guided step), got 3"]
    assert "parallel.shard_weights needs a multi-rank replica" in ParallelConfig(
        shard_weights=True).startup_problems(num_heads=4)[0]


def test_guided_batch_equals_one_rank(flux_single, flux_cfg):
    batch = batch_of(params("a red circle", 3, **GUIDED), params("a green star at night", 4, n=2, **GUIDED))
    outs = _run(flux_cfg, batch)
    _close(flux_single.denoise(batch), outs[0])
    assert all(o.images == [] for o in outs[1:])  # rank 0 decodes alone
    counters = ray.get(flux_cfg[0].counters.remote())
    assert counters["cfg_parallel_branches_steps"] >= 4


def test_unguided_batch_splits_its_rows_and_a_lone_image_runs_on_group_0(flux_single, flux_cfg):
    before = ray.get(flux_cfg[0].counters.remote())
    rows = batch_of(params("a red circle", 3, size=(64, 64), steps=3),
                    params("a blue square", 5, n=2, size=(64, 64), steps=3))
    _close(flux_single.denoise(rows), _run(flux_cfg, rows)[0])
    lone = batch_of(params("a red circle", 3, size=(64, 64), steps=3))
    _close(flux_single.denoise(lone), _run(flux_cfg, lone)[0])
    after = ray.get(flux_cfg[0].counters.remote())
    assert after["cfg_parallel_rows_steps"] - before["cfg_parallel_rows_steps"] == 3
    assert after["cfg_parallel_lone_steps"] - before["cfg_parallel_lone_steps"] == 3


def test_cfg_gate_reuses_the_delta_as_on_one_rank(flux_single, flux_cfg):
    gated = batch_of(*(dataclasses.replace(params(f"prompt {s}", s, **GUIDED), cfg_gate_fraction=0.5)
                       for s in (1, 2)))
    single = flux_single.denoise(gated)
    assert single.cfg_reused_steps == 2
    out = _run(flux_cfg, gated)[0]
    assert out.cfg_reused_steps == 2
    _close(single, out)


def test_lora_and_attention_override_run_on_every_rank(flux_single, flux_cfg):
    """A request's own adapter and kernel apply on both CFG groups (state changes on every rank)."""
    from deployments.config import EMBEDDED_LORA_DIR
    from pipeline.contract.lora import LoraSpec

    p = dataclasses.replace(params("a red circle", 3, **GUIDED), attention_backend="torch_math",
                            lora=(LoraSpec("magenta", 0.8, str(EMBEDDED_LORA_DIR / "magenta")),))
    batch = batch_of(p)
    expected = flux_single.denoise(batch)
    plain = flux_single.denoise(batch_of(params("a red circle", 3, **GUIDED)))
    assert np.abs(expected.images[0] - plain.images[0]).max() > 0.05  # the adapter changes the image
    _close(expected, _run(flux_cfg, batch)[0])


def test_torch_compile_under_cfg_parallelism_equals_one_rank(flux_single, ray_cluster):
    """Each rank compiles its transformer (the cheap "eager" backend) after its Cache-DiT mount."""
    workers = rank_workers({"cfg_degree": 2}, acceleration={"torch_compile": True, "compile_backend": "eager"})
    try:
        batch = batch_of(params("a red circle", 3, **GUIDED), params("a blue square", 4, **GUIDED))
        _close(flux_single.denoise(batch), _run(workers, batch)[0])
        assert all(c["compiles"] == 1 for c in ray.get([w.counters.remote() for w in workers]))
    finally:
        for w in workers:
            ray.kill(w)


def test_cache_dit_decides_each_branch_as_one_rank_does(flux_single, flux_cfg):
    """Each CFG group decides Cache-DiT for its own branch, as one rank decides each branch of a
    separate-CFG batch; the ranks sharing a sequence decide together (DESIGN: the statistic is
    reduced over the sequence-parallel group). cache-dit reduced it over every rank, so both
    branches cached the same steps and the image differed from one rank's by up to 43/255
    (helper-37's review); with the CFG gate group 1 keeps calling its context (no hang)."""
    key = CacheDiTParams(Fn_compute_blocks=1, max_warmup_steps=1, residual_diff_threshold=0.5)
    for gate in (1.0, 0.5):
        batch = batch_of(*(dataclasses.replace(params("a red circle on a blue background", 7 + i, negative="a green square",
                                                      true_cfg_scale=4.0, size=(64, 64), steps=6),
                                               enable_cache_dit=True, cache_dit_params=key, cfg_gate_fraction=gate)
                           for i in range(2)))
        _close(flux_single.denoise(batch), _run(flux_cfg, batch)[0])
        stats = ray.get([w.cache_stats.remote() for w in flux_cfg])
        half = len(stats) // 2  # the CFG groups: ranks [0, half) and [half, 2 half)
        for group in (stats[:half], stats[half:]):
            assert all(s == group[0] for s in group)
        assert stats[0]["cached_steps"] != stats[half]["cached_steps"]  # this prompt: the branches differ
    counters = ray.get(flux_cfg[0].counters.remote())
    assert counters["cfg_parallel_lockstep_steps"] >= 2


@pytest.mark.parametrize("dual", ["boundary", "paired"])
def test_wan_guided_video_with_two_transformers_equals_one_rank(ray_cluster, dual):
    """Boundary experts: both groups run the step's expert (one the negative prompt); paired
    transformers: group 0 runs ``transformer``, group 1 ``transformer_2``, at the same time."""
    runner = BatchRunner("tiny-wan-moe", dual_transformer=dual)
    fields = dict(guidance_scale=4.0, num_inference_steps=4, size="64x64")
    if dual == "boundary":
        fields["negative_prompt"] = "blurry"
    batch = batch_of(video_params(runner.family, "a red circle", 3, **fields),
                     video_params(runner.family, "a green star at night", 4, **fields))
    single = runner.denoise(batch)
    workers = rank_workers({"cfg_degree": 2}, model={"name": "tiny-wan-moe", "dual_transformer": dual})
    try:
        out = _run(workers, batch)[0]
        assert out.calls == single.calls
        _close(single, out)
        # Cache-DiT, its own knobs for the second transformer (refused for paired transformers
        # under CFG parallelism while both groups took one decision; helper-38's review)
        secondary = {"max_warmup_steps": 2, "residual_diff_threshold": 0.05} if dual == "paired" else None
        key = CacheDiTParams(Fn_compute_blocks=1, max_warmup_steps=1, residual_diff_threshold=0.5, secondary=secondary)
        cached = batch_of(*(dataclasses.replace(p, enable_cache_dit=True, cache_dit_params=key) for p in batch.requests))
        _close(runner.denoise(cached), _run(workers, cached)[0])
        # the report: transformer_2 of paired transformers caches on group 1, and rank 0 reports
        # that group's count (helper-55: 0 where one rank cached 14)
        eager = CacheDiTParams(Fn_compute_blocks=1, max_warmup_steps=2, residual_diff_threshold=0.9,
                               secondary={"max_warmup_steps": 2, "residual_diff_threshold": 0.9} if secondary else None)
        cached = batch_of(*(dataclasses.replace(
            video_params(runner.family, p.prompt, p.seed, **{**fields, "num_inference_steps": 8}),
            enable_cache_dit=True, cache_dit_params=eager) for p in batch.requests))
        for gate in (1.0, 0.5):  # gated: group 1's forwards after the gate are unused (helper-58)
            gated = batch_of(*(dataclasses.replace(p, cfg_gate_fraction=gate) for p in cached.requests))
            one = runner.run(gated)[0].acceleration.cache_dit
            two = ray.get([w.run_batch.remote(gated) for w in workers], timeout=300)[0][0].acceleration.cache_dit
            assert two.transformers == one.transformers and (two.cached_steps, two.computed_steps) == \
                (one.cached_steps, one.computed_steps)
            assert all(t.cached_steps > 0 for t in one.transformers.values() if t.steps > 2)
            primary = one.transformers["transformer"]  # the top level is the primary's (helper-55: 13 of 16
            # steps "computed" on boundary experts where the primary computed 2 of its 5)
            assert (one.cached_steps, one.computed_steps) == (primary.cached_steps,
                                                              primary.steps - primary.cached_steps)
    finally:
        for w in workers:
            ray.kill(w)


def test_cfg_replica_serves_and_reports_its_layout(deploy):
    """configs/tiny-cpu-cfg2.yaml's layout behind Serve: guided and unguided requests answered,
    the layout and how its steps ran in /v1/stats."""
    import httpx

    from tests.test_parallel import CFG2

    url = deploy(CFG2)
    guided = {"prompt": "a red circle", "seed": 3, "num_inference_steps": 3, "negative_prompt": "blurry",
              "true_cfg_scale": 2.0}
    for body in (guided, {"prompt": "a red circle", "seed": 3, "num_inference_steps": 3, "n": 2}):
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["ditserve"]["world_size"] == 2
    import time

    deadline = time.monotonic() + 30  # replicas report every routing_stats_period_s
    while True:
        (replica,) = httpx.get(f"{url}/v1/stats").json()["router"]["replicas"].values()
        done = replica.get("cfg_parallel_branches_steps", 0) >= 3 and replica.get("cfg_parallel_rows_steps", 0) >= 3
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert replica["parallel"]["cfg_degree"] == 2 and done


@pytest.mark.parametrize("layout", [{"cfg_degree": 2}, {"cfg_degree": 2, "shard_weights": True}],
                         ids=["cfg2", "cfg2-sharded"])
def test_bf16_wan_whose_latents_stay_float32_agrees_on_every_rank(ray_cluster, layout):
    """Wan keeps float32 latents while its transformers predict in bf16: the predictions group 0
    broadcasts (a lone video; the steps after the CFG gate in lockstep) travel in the transformers'
    dtype on both ends, so group 1's latents, and its tiles of the shared decode, match rank 0's."""
    model = {"name": "tiny-wan", "dtype": "bfloat16", "vae": {"tiling": True}}
    single = BatchRunner("tiny-wan", dtype="bfloat16", vae_tiling=True)
    _small_tiles(single)
    workers = rank_workers(layout, model=model)
    try:
        ray.get([w.__ray_call__.remote(lambda actor: _small_tiles(actor.runner)) for w in workers])
        for fields in (dict(guidance_scale=1.0, num_inference_steps=3, size="64x64"),
                       dict(guidance_scale=4.0, negative_prompt="blurry", num_inference_steps=4, size="64x64",
                            cfg_gate_step=0.5)):
            batch = batch_of(video_params(single.family, "a red circle", 3, **fields))
            expected = single.denoise(batch).images[0]
            assert np.abs(expected - _run(workers, batch)[0].images[0]).max() <= 1e-3
    finally:
        for w in workers:
            ray.kill(w)


@pytest.mark.parametrize("layout", [{"ulysses_degree": 2, "shard_weights": True},
                                    {"cfg_degree": 2, "shard_weights": True}], ids=["ulysses2", "cfg2"])
def test_sharded_weights_equal_unsharded_with_half_the_bytes_per_rank(flux_single, ray_cluster, layout):
    """FSDP2 (parallel.fsdp) under each layout: guided, unguided (under cfg 2 both groups run
    the same blocks in lockstep: FSDP gathers are collectives over every rank) and with
    Cache-DiT, each equal to one rank; each rank holds about half the transformer."""
    workers = rank_workers(layout)
    try:
        guided = batch_of(params("a red circle", 3, **GUIDED), params("a blue square", 4, **GUIDED))
        _close(flux_single.denoise(guided), _run(workers, guided)[0])
        lone = batch_of(params("a red circle", 3, size=(64, 64), steps=3))
        _close(flux_single.denoise(lone), _run(workers, lone)[0])
        key = CacheDiTParams(Fn_compute_blocks=1, max_warmup_steps=2, residual_diff_threshold=0.5)
        cached = batch_of(dataclasses.replace(params("a red circle", 3, **{**GUIDED, "steps": 6}),
                                              enable_cache_dit=True, cache_dit_params=key))
        alone = flux_single.denoise(cached)
        assert flux_single.cache["transformer"].cached_steps() > 0  # else equal images would show nothing of it
        _close(alone, _run(workers, cached)[0])  # helper-71: it checked only that the images were finite
        whole = sum(t.numel() * t.element_size() for t in flux_single.family.transformer.parameters())
        held = ray.get(workers[1].ready.remote())  # rank 1 loads the transformer alone
        assert held < 0.6 * whole
    finally:
        for w in workers:
            ray.kill(w)


def _small_tiles(runner) -> None:
    """Tiles of 48 pixels at a stride of 32, so 64x64 outputs have 2 x 2 of them."""
    vae = runner.family.pipe.vae
    if vae is not None:
        vae.tile_sample_min_height = vae.tile_sample_min_width = 48
        vae.tile_sample_stride_height = vae.tile_sample_stride_width = 32


def test_video_decodes_in_parallel_as_one_rank_tiled_decode(ray_cluster):
    """model.vae.tiling on a 2-rank replica: every rank loads the VAE and decodes its tiles,
    rank 0 blends them — the pixels of one rank's tiled decode (parallel.vae)."""
    single = BatchRunner("tiny-wan", vae_tiling=True)
    _small_tiles(single)
    batch = batch_of(video_params(single.family, "a red circle", 3, num_inference_steps=3, size="64x64"))
    expected = single.denoise(batch)
    workers = rank_workers({"ulysses_degree": 2}, model={"name": "tiny-wan", "vae": {"tiling": True}})
    try:
        assert ray.get([w.__ray_call__.remote(lambda actor: actor.runner.parallel_vae) for w in workers]) == [True] * 2
        ray.get([w.__ray_call__.remote(lambda actor: _small_tiles(actor.runner)) for w in workers])
        out = _run(workers, batch)[0]
        _close(expected, out)
        untiled = BatchRunner("tiny-wan").denoise(batch).images[0]
        assert np.abs(untiled - out.images[0]).mean() <= 0.1  # seams blended: the bound of tests/test_weights.py
    finally:
        for w in workers:
            ray.kill(w)
