"""Per-request accelerations on the tiny model with the real cache-dit package (in-process)."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.accel import freeze_cache_dit_params
from pipeline.attention import kernel_rejections
from pipeline.cache_dit_state import (MOUNT, NONE, REFRESH, REMOUNT, UNMOUNT, CacheKey, build_cache_config,
                                      cache_transition, register_blocks)
from pipeline.contract import ServingLimits, validate_image_request
from pipeline.runner import Batch, BatchRunner
from pipeline.sampling import AccelerationDefaults, resolve
from pipeline.signature import BatchSignature

LIMITS = ServingLimits("tiny-flux", 8, 64, 64, 12, 3.5, num_blocks=10)


def run(runner, *bodies, defaults=AccelerationDefaults()):
    params = tuple(resolve(validate_image_request(b, LIMITS), LIMITS, defaults) for b in bodies)
    return runner.run(Batch("b", BatchSignature.of(params[0]), params))


def pixels(out) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(out.pngs[0])), dtype=np.int16)


@pytest.fixture(scope="module")
def runner():
    return BatchRunner("tiny-flux")


BASE = {"prompt": "a red circle", "seed": 1, "num_inference_steps": 12}
STATIC_FAST = {"scm_preset": "fast", "scm_policy": "static"}


# -- the transition table -----------------------------------------------------------------
A, B = CacheKey((), False), CacheKey((("Fn_compute_blocks", 2),), False)


@pytest.mark.parametrize("active, wanted, expected", [
    (None, None, NONE), (None, A, MOUNT), (A, A, REFRESH), (A, B, REMOUNT), (A, None, UNMOUNT),
    (A, CacheKey((), True), REMOUNT),  # CFG mode changed: has_separate_cfg follows the batch
])
def test_transition_table(active, wanted, expected):
    assert cache_transition(active, wanted) == expected


def test_resolution_rules_feed_the_table():
    def wanted(body, defaults=AccelerationDefaults()):
        return resolve(validate_image_request({"prompt": "a", **body}, LIMITS), LIMITS, defaults).enable_cache_dit

    on = AccelerationDefaults(enable_cache_dit=True)
    assert wanted({"enable_cache_dit": True})
    assert not wanted({"enable_cache_dit": False}, on)  # False beats a default of on
    assert not wanted({})  # None follows a default of off: after True, this unmounts
    assert wanted({}, on)


def test_secondary_inherits_primary_knobs_and_scm_masks_reach_cache_dit():
    key = freeze_cache_dit_params({"Fn_compute_blocks": 2, "residual_diff_threshold": 0.2,
                                   "secondary": {"Bn_compute_blocks": 1}, **STATIC_FAST})
    config, calibrator = build_cache_config(key, 28, separate_cfg=True)
    assert config.Fn_compute_blocks == 2 and config.enable_separate_cfg and calibrator is None
    assert config.steps_computation_policy == "static"
    import cache_dit
    assert config.steps_computation_mask == cache_dit.steps_mask(total_steps=28, mask_policy="fast")
    bins = freeze_cache_dit_params({"scm_compute_bins": [4, 2, 2], "scm_cache_bins": [2, 2]})
    config, _ = build_cache_config(bins, 12, separate_cfg=False)
    assert config.steps_computation_mask == [1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    _, calibrator = build_cache_config(freeze_cache_dit_params({"enable_taylorseer": True, "taylorseer_order": 2}),
                                       12, False)
    assert calibrator.taylorseer_order == 2


# -- the executor on a real model ---------------------------------------------------------
def test_cache_dit_lifecycle_on_the_tiny_model(runner):
    exact = run(runner, BASE)[0]
    assert exact.acceleration["cache_dit"] == {"active": False, "transition": "none", "cached_steps": 0,
                                               "computed_steps": 12}
    on = {**BASE, "enable_cache_dit": True, "cache_dit_params": STATIC_FAST}
    first = run(runner, on)[0]
    assert first.acceleration["cache_dit"]["transition"] == "mount"
    assert first.acceleration["cache_dit"]["cached_steps"] > 0  # the SCM mask really skips steps
    # same overrides, other step count and batch size: refresh only, no crash
    again = run(runner, {**on, "num_inference_steps": 8}, {**on, "num_inference_steps": 8, "seed": 2})
    assert again[0].acceleration["cache_dit"]["transition"] == "refresh"
    assert again[0].acceleration["cache_dit"]["computed_steps"] + again[0].acceleration["cache_dit"][
        "cached_steps"] == 8
    changed = run(runner, {**on, "cache_dit_params": {**STATIC_FAST, "Fn_compute_blocks": 4}})[0]
    assert changed.acceleration["cache_dit"]["transition"] == "remount"
    off = run(runner, BASE)[0]
    assert off.acceleration["cache_dit"]["transition"] == "unmount"
    assert off.pngs == exact.pngs  # unmounted is exactly the uncached output
    assert not hasattr(runner.family.transformer, "_context_manager")
    c = runner.counters()
    assert (c["mounts"], c["refreshes"], c["remounts"], c["unmounts"]) >= (1, 1, 1, 1)


def test_failed_mount_leaves_the_replica_unmounted_and_serving(runner):
    # Fn_compute_blocks beyond the model's depth: the ingress refuses it; past the ingress,
    # cache-dit itself fails on the first forward.
    bad = resolve(validate_image_request({**BASE, "enable_cache_dit": True}, LIMITS), LIMITS)
    bad = dataclasses.replace(bad, cache_dit_params=(("Fn_compute_blocks", 50),))
    with pytest.raises(Exception):
        runner.run(Batch("bad", BatchSignature.of(bad), (bad,)))
    assert runner.cache.active is None and not hasattr(runner.family.transformer, "_context_manager")
    assert run(runner, BASE)[0].acceleration["cache_dit"]["active"] is False


def test_cfg_gating_reuses_the_delta_and_one_is_exact(runner):
    cfg = {**BASE, "negative_prompt": "blurry", "true_cfg_scale": 4.0}
    exact = run(runner, cfg)[0]
    assert run(runner, {**cfg, "cfg_gate_step": 1.0})[0].pngs == exact.pngs
    gated = run(runner, {**cfg, "cfg_gate_step": 0.5})[0]
    assert gated.acceleration["cfg_gate"] == {"gate_step": 0.5, "reused_steps": 6}
    assert gated.pngs != exact.pngs
    assert np.abs(pixels(gated) - pixels(exact)).mean() < 40  # an approximation, not noise
    no_cfg = run(runner, {**BASE, "cfg_gate_step": 0.5})[0]  # a no-op without CFG
    assert no_cfg.acceleration["cfg_gate"]["reused_steps"] == 0
    assert no_cfg.pngs == run(runner, BASE)[0].pngs


def test_cfg_gating_with_cache_dit_separate_cfg(runner):
    body = {**BASE, "negative_prompt": "blurry", "true_cfg_scale": 4.0, "cfg_gate_step": 0.5,
            "enable_cache_dit": True, "cache_dit_params": STATIC_FAST}
    out = run(runner, body)[0]
    assert out.acceleration["cfg_gate"]["reused_steps"] == 6
    assert out.acceleration["cache_dit"]["cached_steps"] > 0
    run(runner, BASE)  # unmount


def test_attention_override_switches_and_back_exactly(runner):
    default = run(runner, BASE)[0]
    math = run(runner, {**BASE, "attention_backend_override": "torch_math"})[0]
    assert math.acceleration["attention_backend"] == "torch_math"
    assert np.abs(pixels(math) - pixels(default)).max() <= 1  # exact kernels: same image
    back = run(runner, BASE)[0]
    assert back.acceleration["attention_backend"] == "default" and back.pngs == default.pngs
    assert all(p._attention_backend is None for p in runner.attention.layers)
    before = runner.attention.switches
    run(runner, BASE)
    assert runner.attention.switches == before  # a repeat of the active target is a no-op


def test_kernel_rejections_list_every_reason():
    reasons = kernel_rejections("fa", device=torch.device("cpu"), dtype=torch.float32, torch_compile=True,
                                num_layers=0, ring_degree=2)
    text = " | ".join(reasons)
    for part in ("torch.compile", "no switchable", "ring_degree=2", "CUDA", "float32"):
        assert part in text
    assert kernel_rejections("torch_math", device=torch.device("cpu"), dtype=torch.float32,
                             torch_compile=False, num_layers=4) == []
    assert "hub" in " ".join(kernel_rejections("sage_attn_3", device=torch.device("cuda"), dtype=torch.bfloat16,
                                               torch_compile=False, num_layers=4))


def test_compile_happens_after_mount_and_only_once():
    runner = BatchRunner("tiny-flux", torch_compile=True, compile_backend="eager")
    on = AccelerationDefaults(enable_cache_dit=True, cache_dit_params=freeze_cache_dit_params(STATIC_FAST))
    head = resolve(validate_image_request({**BASE, "num_inference_steps": 4}, LIMITS), LIMITS, on)
    runner.warmup(head)
    assert runner.events[:2] == [("mount", "mount"), ("compile", "transformer", True)]
    run(runner, {**BASE, "num_inference_steps": 4}, defaults=on)
    run(runner, {**BASE, "num_inference_steps": 4, "cache_dit_params": {"scm_preset": "slow"}}, defaults=on)
    run(runner, {**BASE, "num_inference_steps": 4})
    assert runner.compiles == 1 and [e[0] for e in runner.events].count("compile") == 1
    facts = runner.facts()
    assert "torch.compile" in " ".join(facts.attention_rejections["torch_math"])


def test_registry_adapts_a_transformer_cache_dit_does_not_know():
    from diffusers import FluxTransformer2DModel

    class TinyDiT(FluxTransformer2DModel):  # cache-dit's register matches by class-name prefix
        pass

    runner = BatchRunner("tiny-flux")
    transformer = runner.family.transformer
    transformer.__class__ = TinyDiT
    with pytest.raises(ValueError, match="no adapter for TinyDiT"):
        run(runner, {**BASE, "enable_cache_dit": True})
    register_blocks("TinyDiT", ("transformer_blocks", "single_transformer_blocks"), ("Pattern_1", "Pattern_1"))
    # per block list, like cache-dit's own Flux adapter: Fn must fit the 2 double-stream blocks
    out = run(runner, {**BASE, "enable_cache_dit": True, "cache_dit_params": {**STATIC_FAST, "Fn_compute_blocks": 1}})[0]
    assert out.acceleration["cache_dit"]["active"] and out.acceleration["cache_dit"]["cached_steps"] > 0
