"""Per-request accelerations on the tiny model with the real cache-dit package (in-process)."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

from compat import cache_dit as cache_dit_compat
from compat import diffusers as diffusers_compat
from parallel.kernels import kernel_rejections
from pipeline.cache_dit_actions import build_cache_config, register_blocks
from pipeline.cache_dit_params import CacheDiTParams
from pipeline.contract.images import validate_image_request
from pipeline.contract.limits import ServingLimits
from pipeline.runner import BatchRunner
from pipeline.sampling import AccelerationDefaults, resolve
from pipeline.state import CacheKey, CacheTransition, StateTransitionError, cache_transition
from tests.helpers import batch_of
from tests.helpers import pixels as png_pixels

LIMITS = ServingLimits("tiny-flux", 8, 64, 64, 12, 3.5, num_blocks=10)
NONE, MOUNT, REFRESH, UNMOUNT, REMOUNT = (CacheTransition.NONE, CacheTransition.MOUNT, CacheTransition.REFRESH,
                                          CacheTransition.UNMOUNT, CacheTransition.REMOUNT)


def run(runner, *bodies, defaults=AccelerationDefaults()):
    params = tuple(resolve(validate_image_request(b, LIMITS), LIMITS, defaults) for b in bodies)
    return runner.run(batch_of(*params))


def pixels(out) -> np.ndarray:
    return png_pixels(out.images[0])


@pytest.fixture(scope="module")
def runner():
    return BatchRunner("tiny-flux")


BASE = {"prompt": "a red circle", "seed": 1, "num_inference_steps": 12}
STATIC_FAST = {"scm_preset": "fast", "scm_policy": "static"}


# -- the transition table -----------------------------------------------------------------
A, B = CacheKey(CacheDiTParams(), False), CacheKey(CacheDiTParams(Fn_compute_blocks=2), False)


@pytest.mark.parametrize("active, wanted, expected", [
    (None, None, NONE), (None, A, MOUNT), (A, A, REFRESH), (A, B, REMOUNT), (A, None, UNMOUNT),
    (A, CacheKey(CacheDiTParams(), True), REMOUNT),  # CFG mode changed: has_separate_cfg follows the batch
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


def test_cache_dit_knobs_a_request_did_not_give_are_checked_like_its_own(runner):
    """The server's default ``acceleration.cache_dit_params``, and cache-dit's own defaults for
    ``enable_cache_dit`` alone, reached the batch unchecked: cache-dit asserted
    ``Fn_compute_blocks`` within the model's blocks there and the batch failed 500. Now each is
    a 400 naming ``cache_dit_params``, on every route, for the steps that run (an edit's
    ``strength``); a request's own knobs or ``enable_cache_dit: false`` go past a bad default."""
    from PIL import Image

    from pipeline.contract.edits import validate_edit_request
    from pipeline.contract.videos import validate_video_request
    from pipeline.errors import InvalidRequestError
    from pipeline.modes import DualMode, InputMode
    from pipeline.sampling import resolve_edit, resolve_video

    too_many = AccelerationDefaults(enable_cache_dit=True, cache_dit_params=CacheDiTParams(Fn_compute_blocks=20))
    with pytest.raises(AssertionError, match="Fn_compute_blocks 20"):  # what the batch met
        runner.run(batch_of(dataclasses.replace(
            resolve(validate_image_request({**BASE, "cache_dit_params": {"Fn_compute_blocks": 2}}, LIMITS), LIMITS),
            cache_dit_params=too_many.cache_dit_params)))

    def refused(resolving) -> str:
        with pytest.raises(InvalidRequestError) as info:
            resolving()
        assert info.value.param == "cache_dit_params" and info.value.status_code == 400
        return str(info.value)

    image = lambda body, limits=LIMITS, defaults=too_many: resolve(  # noqa: E731
        validate_image_request({**BASE, **body}, limits), limits, defaults)
    assert "the server's default acceleration.cache_dit_params" in refused(lambda: image({}))
    assert "= 20 exceeds the model's 10 transformer blocks" in refused(lambda: image({}))
    assert not image({"enable_cache_dit": False}).enable_cache_dit
    assert image({"cache_dit_params": {"Fn_compute_blocks": 2}}).cache_dit_params.Fn_compute_blocks == 2
    four_blocks = dataclasses.replace(LIMITS, num_blocks=4)
    message = refused(lambda: image({"enable_cache_dit": True}, four_blocks, AccelerationDefaults()))
    assert "cache-dit's own defaults" in message and "(Fn_compute_blocks unset: cache-dit's 8)" in message
    assert image({"enable_cache_dit": True, "cache_dit_params": {"Fn_compute_blocks": 3}}, four_blocks,
                 AccelerationDefaults()).enable_cache_dit
    # every block computed at the front and back: a "cached" step reused nothing, yet was reported
    # as cached (helper-51: 7 of 8 steps "cached", the image equal to the exact one)
    for fn, bn in ((4, 0), (3, 1), (1, 3)):
        assert "= 4 leaves no block to cache of the model's 4 transformer blocks (at most 3" in refused(
            lambda fn=fn, bn=bn: image({"enable_cache_dit": True, "cache_dit_params": {
                "Fn_compute_blocks": fn, "Bn_compute_blocks": bn}}, four_blocks, AccelerationDefaults()))

    # FLUX.2: two block lists cached apart (8 double-stream, 16 single-stream blocks in tiny-flux2):
    # Fn + Bn is bounded by the shorter (cache-dit asserts), and at 8 the longer still caches 8
    two_lists = dataclasses.replace(LIMITS, num_blocks=8, longest_block_list=16)
    assert image({"enable_cache_dit": True}, two_lists, AccelerationDefaults()).enable_cache_dit
    assert "= 9 exceeds the model's 8 transformer blocks in its shorter block list (cache-dit caches each " \
           "apart) (at most 8)" in refused(lambda: image(
        {"enable_cache_dit": True, "cache_dit_params": {"Fn_compute_blocks": 8, "Bn_compute_blocks": 1}},
        two_lists, AccelerationDefaults()))

    warm_6 = AccelerationDefaults(enable_cache_dit=True, cache_dit_params=CacheDiTParams(max_warmup_steps=6))
    assert "max_warmup_steps must be at most num_inference_steps (4)" in refused(
        lambda: image({"num_inference_steps": 4}, defaults=warm_6))
    assert image({"num_inference_steps": 8}, defaults=warm_6).enable_cache_dit
    # warmup steps are never cached: as many as the steps would cache none
    assert "max_warmup_steps (6) must be below the 6 steps that run (at most 5)" in refused(
        lambda: image({"num_inference_steps": 6}, defaults=warm_6))
    assert image({"num_inference_steps": 7}, defaults=warm_6).enable_cache_dit
    # cache-dit's own warmup (8) when unset: 8 steps would cache none (helper-52); an SCM mask
    # shortens the warmup, and a static one caches whatever max_continuous_cached_steps says
    bare = AccelerationDefaults()
    assert "max_warmup_steps (unset: cache-dit's 8) must be below the 8 steps that run" in refused(
        lambda: image({"num_inference_steps": 8, "enable_cache_dit": True}, defaults=bare))
    assert image({"num_inference_steps": 9, "enable_cache_dit": True}, defaults=bare).enable_cache_dit
    assert "a run of 1 step leaves Cache-DiT no step to cache" in refused(lambda: image(
        {"num_inference_steps": 1, "enable_cache_dit": True, "cache_dit_params": {"max_warmup_steps": 0}},
        defaults=bare))
    masked = {"num_inference_steps": 8, "enable_cache_dit": True,
              "cache_dit_params": {**STATIC_FAST, "max_warmup_steps": 8, "max_continuous_cached_steps": 0}}
    assert image(masked, defaults=bare).enable_cache_dit
    dynamic = {**masked, "cache_dit_params": {**masked["cache_dit_params"], "scm_policy": "dynamic"}}
    assert "max_continuous_cached_steps must be -1 (no limit) or at least 1, got 0" in refused(
        lambda: image(dynamic, defaults=bare))
    # explicit bins whose first computes every step that runs (helper-53): nothing cached
    assert "its first bin computes 4 steps, covering all 4 that run" in refused(lambda: image(
        {"num_inference_steps": 4, "enable_cache_dit": True,
         "cache_dit_params": {"scm_compute_bins": [4], "scm_cache_bins": [1], "scm_policy": "static"}}, defaults=bare))
    # a 1-step run: one message, naming num_inference_steps, also with secondary knobs
    one_step = refused(lambda: image({"num_inference_steps": 1, "enable_cache_dit": True}, defaults=bare))
    assert one_step.count("a run of 1 step") == 1 and "num_inference_steps" in one_step
    # which knobs cache nothing matters only where Cache-DiT runs (helper-53: 'false always wins' broke)
    nothing = {"Fn_compute_blocks": 10, "max_continuous_cached_steps": 0}
    for body in ({"enable_cache_dit": False, "num_inference_steps": 8, "cache_dit_params": {"Fn_compute_blocks": 2}},
                 {"enable_cache_dit": False, "num_inference_steps": 1, "cache_dit_params": nothing},
                 {"num_inference_steps": 8, "cache_dit_params": nothing}):  # the server's default: off
        assert not image(body, defaults=bare).enable_cache_dit, body
    on_by_default = AccelerationDefaults(enable_cache_dit=True)
    message = refused(lambda: image({"num_inference_steps": 8, "cache_dit_params": nothing}, defaults=on_by_default))
    assert "= 10 leaves no block to cache of the model's 10 transformer blocks (at most 9" in message
    assert "max_continuous_cached_steps must be -1 (no limit) or at least 1, got 0" in message
    editing = dataclasses.replace(LIMITS, input_modes=(InputMode.IMAGE_TO_IMAGE,), max_input_pixels=64 * 64)
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(buf, format="PNG")
    edit = lambda strength: resolve_edit(validate_edit_request(  # noqa: E731
        {**BASE, "num_inference_steps": 8, "image": buf.getvalue(), "strength": strength}, editing), editing, warm_6)
    assert edit(1.0).effective_steps == 8
    assert "at most num_inference_steps (4), got 6 (strength 0.5 runs 4 of the 8 steps)" in refused(
        lambda: edit(0.5))  # the server's default knobs: the steps the request gave are named too
    video = ServingLimits("tiny-wan", 16, 64, 48, 12, 5.0, temporal_factor=4, default_num_frames=5, max_frames=9,
                          guidance_embeds=False, num_blocks=10)
    assert "at most num_inference_steps (4)" in refused(lambda: resolve_video(
        validate_video_request({"prompt": "a ball", "num_inference_steps": 4}, video), video, warm_6))
    # an edit's and a video's own knobs that cache nothing, refused where Cache-DiT runs (helper-54)
    own = {"enable_cache_dit": True, "cache_dit_params": {"max_warmup_steps": 4}}
    assert "max_warmup_steps (4) must be below the 4 steps that run (at most 3): warmup steps are never cached, " \
           "so none would be (an SCM mask, scm_preset, shortens the warmup) (strength 0.5 runs 4 of the 8 steps)" \
        in refused(lambda: resolve_edit(validate_edit_request(
            {**BASE, "num_inference_steps": 8, "image": buf.getvalue(), "strength": 0.5, **own}, editing), editing))
    experts = dataclasses.replace(video, dual_mode=DualMode.BOUNDARY)
    secondary = {"enable_cache_dit": True, "cache_dit_params": {"secondary": {"max_continuous_cached_steps": 0}}}
    assert "cache_dit_params.secondary.max_continuous_cached_steps must be -1" in refused(lambda: resolve_video(
        validate_video_request({"prompt": "a ball", "num_inference_steps": 12, **secondary}, experts), experts))


def test_secondary_inherits_primary_knobs_and_scm_masks_reach_cache_dit():
    key = CacheDiTParams.model_validate({"Fn_compute_blocks": 2, "residual_diff_threshold": 0.2,
                                         "secondary": {"Bn_compute_blocks": 1}, **STATIC_FAST})
    config, calibrator = build_cache_config(key.for_transformer("transformer"), 28, separate_cfg=True)
    assert config.Fn_compute_blocks == 2 and config.enable_separate_cfg and calibrator is None
    assert config.steps_computation_policy == "static"
    import cache_dit
    assert config.steps_computation_mask == cache_dit.steps_mask(total_steps=28, mask_policy="fast")
    bins = CacheDiTParams.model_validate({"scm_compute_bins": [4, 2, 2], "scm_cache_bins": [2, 2]})
    config, _ = build_cache_config(bins, 12, separate_cfg=False)
    assert config.steps_computation_mask == [1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    _, calibrator = build_cache_config(CacheDiTParams(enable_taylorseer=True, taylorseer_order=2), 12, False)
    assert calibrator.taylorseer_order == 2
    secondary = key.for_transformer("transformer_2")  # the secondary's knob over the primary's
    assert (secondary.Bn_compute_blocks, secondary.Fn_compute_blocks, secondary.secondary) == (1, 2, None)


# -- the executor on a real model ---------------------------------------------------------
def test_cache_dit_lifecycle_on_the_tiny_model(runner):
    exact = run(runner, BASE)[0]
    assert exact.acceleration.cache_dit.model_dump() == {"active": False, "transition": "none", "cached_steps": 0,
                                                         "computed_steps": 12}
    on = {**BASE, "enable_cache_dit": True, "cache_dit_params": STATIC_FAST}
    first = run(runner, on)[0]
    assert first.acceleration.cache_dit.transition == "mount"
    assert first.acceleration.cache_dit.cached_steps > 0  # the SCM mask really skips steps
    # same overrides, other step count and batch size: refresh only, no crash
    again = run(runner, {**on, "num_inference_steps": 8}, {**on, "num_inference_steps": 8, "seed": 2})
    assert again[0].acceleration.cache_dit.transition == "refresh"
    assert again[0].acceleration.cache_dit.computed_steps + again[0].acceleration.cache_dit.cached_steps == 8
    changed = run(runner, {**on, "cache_dit_params": {**STATIC_FAST, "Fn_compute_blocks": 4}})[0]
    assert changed.acceleration.cache_dit.transition == "remount"
    off = run(runner, BASE)[0]
    assert off.acceleration.cache_dit.transition == "unmount"
    assert off.images == exact.images  # unmounted is exactly the uncached output
    assert not cache_dit_compat.is_mounted(runner.family.transformer)
    c = runner.counters()
    assert (c["mounts"], c["refreshes"], c["remounts"], c["unmounts"]) >= (1, 1, 1, 1)


def test_failed_mount_leaves_the_replica_unmounted_and_serving(runner):
    # Fn_compute_blocks beyond the model's depth: the ingress refuses it; past the ingress,
    # cache-dit itself fails on the first forward.
    bad = resolve(validate_image_request({**BASE, "enable_cache_dit": True}, LIMITS), LIMITS)
    bad = dataclasses.replace(bad, cache_dit_params=CacheDiTParams(Fn_compute_blocks=50))
    with pytest.raises(AssertionError, match="Fn_compute_blocks 50"):  # cache-dit's own check, on the mount
        runner.run(batch_of(bad))
    assert runner.state.cache_key("transformer") is None and not cache_dit_compat.is_mounted(runner.family.transformer)
    assert run(runner, BASE)[0].acceleration.cache_dit.active is False


def test_cfg_gating_reuses_the_delta_and_one_is_exact(runner):
    cfg = {**BASE, "negative_prompt": "blurry", "true_cfg_scale": 4.0}
    exact = run(runner, cfg)[0]
    assert run(runner, {**cfg, "cfg_gate_step": 1.0})[0].images == exact.images
    gated = run(runner, {**cfg, "cfg_gate_step": 0.5})[0]
    assert gated.acceleration.cfg_gate.model_dump() == {"gate_step": 0.5, "reused_steps": 6}
    assert gated.images != exact.images
    assert np.abs(pixels(gated) - pixels(exact)).mean() < 40  # an approximation, not noise
    no_cfg = run(runner, {**BASE, "cfg_gate_step": 0.5})[0]  # a no-op without CFG
    assert no_cfg.acceleration.cfg_gate.reused_steps == 0
    assert no_cfg.images == run(runner, BASE)[0].images


def test_cfg_gating_with_cache_dit_separate_cfg(runner):
    body = {**BASE, "negative_prompt": "blurry", "true_cfg_scale": 4.0, "cfg_gate_step": 0.5,
            "enable_cache_dit": True, "cache_dit_params": STATIC_FAST}
    out = run(runner, body)[0]
    assert out.acceleration.cfg_gate.reused_steps == 6
    assert out.acceleration.cache_dit.cached_steps > 0
    run(runner, BASE)  # unmount


def test_attention_override_switches_and_back_exactly(runner):
    default = run(runner, BASE)[0]
    math = run(runner, {**BASE, "attention_backend_override": "torch_math"})[0]
    assert math.acceleration.attention_backend == "torch_math"
    assert {diffusers_compat.get_processor_backend(p) for p in runner.attention.layers} == {"_native_math"}
    assert np.abs(pixels(math) - pixels(default)).max() <= 1  # exact kernels: same image
    back = run(runner, BASE)[0]
    assert back.acceleration.attention_backend == "default" and back.images == default.images
    assert all(diffusers_compat.get_processor_backend(p) is None for p in runner.attention.layers)
    before = runner.attention.switches
    run(runner, BASE)
    assert runner.attention.switches == before  # a repeat of the active target is a no-op


def test_kernel_rejections_list_every_reason():
    reasons = kernel_rejections("fa", device_type="cpu", dtype="float32", torch_compile=True,
                                num_layers=0, ring_degree=2)
    text = " | ".join(reasons)
    for part in ("torch.compile", "no switchable", "ring_degree=2", "CUDA", "float32"):
        assert part in text
    assert kernel_rejections("torch_math", device_type="cpu", dtype="float32", torch_compile=False, num_layers=4) == []
    assert "hub" in " ".join(kernel_rejections("sage_attn_3", device_type="cuda", dtype="bfloat16",
                                               torch_compile=False, num_layers=4))


def test_compile_happens_after_mount_and_only_once():
    runner = BatchRunner("tiny-flux", torch_compile=True, compile_backend="eager")
    on = AccelerationDefaults(enable_cache_dit=True, cache_dit_params=CacheDiTParams.model_validate(STATIC_FAST))
    head = resolve(validate_image_request({**BASE, "num_inference_steps": 4}, LIMITS), LIMITS, on)
    runner.warmup(head)
    assert list(runner.events)[:2] == [("warmup", "mount", "transformer"), ("warmup", "compile", "transformer")]
    run(runner, {**BASE, "num_inference_steps": 4}, defaults=on)
    run(runner, {**BASE, "num_inference_steps": 4, "cache_dit_params": {"scm_preset": "slow"}}, defaults=on)
    run(runner, {**BASE, "num_inference_steps": 4})
    assert runner.compiles == 1 and [e[1] for e in runner.events].count("compile") == 1
    facts = runner.facts()
    assert "torch.compile" in " ".join(facts.attention_rejections["torch_math"])


def test_switching_cache_dit_keys_under_compile_stays_compiled():
    """cache-dit's compile settings lift dynamo's recompile limit (8) that every mount,
    unmount and remount would use up, after which dynamo silently runs the model uncompiled;
    ``/v1/stats`` counts compiled graphs and recompile-limit hits."""
    import torch._dynamo.config as dynamo_config

    from compat.torch import dynamo_counts

    hits_before = dynamo_counts()["recompile_limit_hits"]  # dynamo's counters are per process
    runner = BatchRunner("tiny-flux", torch_compile=True, compile_backend="eager")
    assert dynamo_config.recompile_limit > 8
    on = AccelerationDefaults(enable_cache_dit=True, cache_dit_params=CacheDiTParams.model_validate(STATIC_FAST))
    presets = ["fast", "medium", "slow", "ultra"]
    for i in range(12):  # 12 state changes: more than dynamo's default limit of 8
        body = {**BASE, "num_inference_steps": (4, 6)[i % 2], "seed": i}  # steps the presets take
        if i % 3 == 2:
            run(runner, body)  # exact: unmount
        else:
            run(runner, {**body, "cache_dit_params": {**STATIC_FAST, "scm_preset": presets[i % 4]}}, defaults=on)
    counters = runner.counters()
    assert runner.compiles == 1 and counters["compiled_graphs"] > 0
    assert counters["recompile_limit_hits"] == hits_before and counters["recompile_limit"] == dynamo_config.recompile_limit
    assert sum(counters.get(k, 0) for k in ("mounts", "remounts", "refreshes", "unmounts")) >= 9


def test_registry_adapts_a_transformer_cache_dit_does_not_know():
    from diffusers import FluxTransformer2DModel

    class TinyDiT(FluxTransformer2DModel):  # cache-dit's register matches by class-name prefix
        pass

    runner = BatchRunner("tiny-flux")
    transformer = runner.family.transformer
    transformer.__class__ = TinyDiT
    with pytest.raises(StateTransitionError, match="ValueError: cache-dit has no adapter for TinyDiT"):
        run(runner, {**BASE, "enable_cache_dit": True})
    assert runner.counters()["mount_failures"] == 1
    register_blocks("TinyDiT", ("transformer_blocks", "single_transformer_blocks"), ("Pattern_1", "Pattern_1"))
    # per block list, like cache-dit's own Flux adapter: Fn must fit the 2 double-stream blocks
    out = run(runner, {**BASE, "enable_cache_dit": True, "cache_dit_params": {**STATIC_FAST, "Fn_compute_blocks": 1}})[0]
    assert out.acceleration.cache_dit.active and out.acceleration.cache_dit.cached_steps > 0


def test_a_failed_unmount_fails_its_batch_is_counted_and_the_next_batch_runs_exact(monkeypatch):
    """helper-67: an unmount that raised failed its batch without a count (``mount_failures``
    counted mounts only). The hooks are removed, so the next batch is the exact run."""
    from compat import cache_dit as compat_cache_dit

    runner = BatchRunner("tiny-flux")
    exact = run(runner, BASE)[0]
    run(runner, {**BASE, "enable_cache_dit": True, "cache_dit_params": STATIC_FAST})
    disable = compat_cache_dit.disable_cache
    calls = []

    def fails_once(transformer):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unmount broke")
        disable(transformer)

    monkeypatch.setattr(compat_cache_dit, "disable_cache", fails_once)
    with pytest.raises(StateTransitionError, match="unmount transformer failed: RuntimeError: unmount broke"):
        run(runner, BASE)
    assert runner.counters()["mount_failures"] == 1 and runner.counters()["unmounts"] == 0
    again = run(runner, BASE)[0]
    assert np.array_equal(again.images[0], exact.images[0])


def test_state_actions_are_logged_with_the_batch_id_and_the_record_is_bounded(runner, caplog):
    import logging

    from pipeline.runner import EVENTS_KEPT

    with caplog.at_level(logging.INFO, logger="ditserve"):
        run(runner, {**BASE, "attention_backend_override": "torch_math", "enable_cache_dit": True})
        run(runner, BASE)
    lines = [r.getMessage() for r in caplog.records if r.name == "ditserve.runner"]
    assert lines == ["batch b: switch_kernel torch_math", "batch b: mount transformer",
                     "batch b: switch_kernel default", "batch b: unmount transformer"]
    assert runner.events.maxlen == EVENTS_KEPT
    for _ in range(EVENTS_KEPT + 5):  # a long-lived replica keeps only the newest actions
        runner.events.append(("b", "refresh", "transformer"))
    assert len(runner.events) == EVENTS_KEPT


def test_defaults_that_cache_nothing_fail_the_replicas_warmup_naming_acceleration(runner):
    """Cache-DiT on by default, cache-dit's own warmup (8) and 8 default steps: the warmup request
    (the server's defaults) would cache nothing; the replica's start says so naming the config,
    not as a request's 400 (helper-54). One more default step is taken."""
    from deployments.replica import default_params

    limits = {"default_steps": 8, "default_size": "64x64"}
    with pytest.raises(ValueError, match=r"^acceleration: the server's defaults .*max_warmup_steps \(unset"):
        default_params("tiny-flux", {"enable_cache_dit": True}, limits, runner.facts())
    assert default_params("tiny-flux", {"enable_cache_dit": True}, {**limits, "default_steps": 9},
                          runner.facts()).enable_cache_dit


def test_what_validation_lets_through_as_cacheable_caches(runner):
    """(Last: it leaves the module's runner mounted.) The knobs validation accepts at its edges
    do cache on the real model: a static SCM mask with a warmup of every step and no continuous
    cached steps (cache-dit shortens the warmup to the mask's first computed steps; a static mask
    ignores the continuous limit), and Fn + Bn one below the blocks (helper-52 measured both; at
    the blocks the image was the exact one)."""
    exact = run(runner, {**BASE, "num_inference_steps": 8})[0]
    for knobs in ({**STATIC_FAST, "max_warmup_steps": 8, "max_continuous_cached_steps": 0},
                  {"Fn_compute_blocks": 1, "Bn_compute_blocks": 8, "max_warmup_steps": 1,
                   "residual_diff_threshold": 1e5}):
        out = run(runner, {**BASE, "num_inference_steps": 8, "enable_cache_dit": True, "cache_dit_params": knobs})[0]
        assert out.acceleration.cache_dit.cached_steps > 0 and out.images != exact.images, knobs


def test_knob_defaults_are_the_installed_cache_dits():
    """Validation (``DEFAULT_FN_COMPUTE_BLOCKS``, ``DEFAULT_MAX_WARMUP_STEPS``) and the canonical
    override (``KNOB_DEFAULTS``: knobs equal to them are dropped) count on cache-dit's defaults."""
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    from pipeline.cache_dit_params import DEFAULT_FN_COMPUTE_BLOCKS, DEFAULT_MAX_WARMUP_STEPS, KNOB_DEFAULTS

    installed = {f.name: f.default for f in dataclasses.fields(DBCacheConfig)}
    installed["taylorseer_order"] = next(f.default for f in dataclasses.fields(TaylorSeerCalibratorConfig)
                                         if f.name == "taylorseer_order")
    assert {k: v for k, v in KNOB_DEFAULTS.items() if k != "enable_taylorseer"} == \
        {k: installed[k] for k in KNOB_DEFAULTS if k != "enable_taylorseer"}
    assert KNOB_DEFAULTS["enable_taylorseer"] is False  # ours: no calibrator unless asked
    assert (DEFAULT_FN_COMPUTE_BLOCKS, DEFAULT_MAX_WARMUP_STEPS) == (installed["Fn_compute_blocks"],
                                                                     installed["max_warmup_steps"])


def test_cache_dit_knobs_are_checked_as_given_then_made_canonical():
    """helper-56: canonicalising before the checks dropped what a request or the server gave
    (a ``secondary`` knob equal to the primary's went unnamed, so fixing it took two round
    trips; a given warmup of 8 read "unset"; a server default's ``secondary`` on a
    one-transformer model passed). The knobs are checked as given, and only a request that
    passes carries the canonical ones."""
    from pipeline.errors import InvalidRequestError
    from pipeline.modes import DualMode

    def message(body, limits=LIMITS, defaults=AccelerationDefaults()) -> str:
        with pytest.raises(InvalidRequestError) as info:
            resolve(validate_image_request({**BASE, "num_inference_steps": 8, **body}, limits), limits, defaults)
        return str(info.value)

    dual = dataclasses.replace(LIMITS, dual_mode=DualMode.BOUNDARY)
    both = message({"enable_cache_dit": True, "cache_dit_params": {
        "max_warmup_steps": 2, "max_continuous_cached_steps": 0, "secondary": {"max_continuous_cached_steps": 0}}},
        dual)
    assert "cache_dit_params.max_continuous_cached_steps" in both
    assert "cache_dit_params.secondary.max_continuous_cached_steps" in both
    given = message({"enable_cache_dit": True, "cache_dit_params": {"max_warmup_steps": 8}})
    assert "max_warmup_steps (8)" in given and "unset" not in given
    given = message({"enable_cache_dit": True, "cache_dit_params": {  # helper-57: Fn 8 read "unset" here too
        "Fn_compute_blocks": 8, "Bn_compute_blocks": 3, "max_warmup_steps": 2}})
    assert "= 11 exceeds the model's 10 transformer blocks" in given and "unset" not in given
    given = message({"enable_cache_dit": True, "cache_dit_params": {
        "Fn_compute_blocks": 2, "max_warmup_steps": 2, "secondary": {"Fn_compute_blocks": 8, "Bn_compute_blocks": 2}}},
        dual)
    assert "cache_dit_params.secondary" in given and "unset" not in given
    server = AccelerationDefaults(enable_cache_dit=True, cache_dit_params=CacheDiTParams(max_warmup_steps=8))
    assert "the server's default acceleration.cache_dit_params" in message({}, defaults=server)
    secondary = AccelerationDefaults(enable_cache_dit=True, cache_dit_params=CacheDiTParams.model_validate(
        {"max_warmup_steps": 2, "secondary": {"max_warmup_steps": 2}}))
    assert "only for models with two transformers" in message({}, defaults=secondary)
    passed = resolve(validate_image_request({**BASE, "num_inference_steps": 8, "enable_cache_dit": True,
                                             "cache_dit_params": {"Fn_compute_blocks": 8, "max_warmup_steps": 2}},
                                            LIMITS), LIMITS)
    assert passed.cache_dit_params == CacheDiTParams(max_warmup_steps=2)  # Fn 8 is cache-dit's default
