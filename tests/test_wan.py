"""Wan family: our loop equals diffusers' WanPipeline; boundary experts and paired-per-step
transformers run the steps they should (counted with forward hooks)."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from compat import cache_dit as cache_dit_compat
from compat import diffusers as diffusers_compat
from pipeline.families import load_family
from pipeline.loop import denoise_batch, gate_step, step_plan, steps_per_transformer
from pipeline.modes import DualMode, GuidanceMode
from pipeline.tiny.wan import TinyWanArch, ensure_tiny_wan
from tests.helpers import batch_of
from tests.helpers import video_params as params

TOL = 1e-4  # max abs pixel difference, frames in [0, 1]


def load(dual=None):
    return load_family("wan", ensure_tiny_wan(arch=TinyWanArch(dual=dual)), torch_dtype=torch.float32,
                       device="cpu")


@pytest.fixture(scope="module")
def wan():
    return load()


@pytest.fixture(scope="module")
def wan_moe():
    return load("boundary")


@pytest.fixture(scope="module")
def wan_paired():
    return load("paired")


def reference(family, p, guidance_scale_2=None) -> np.ndarray:
    kwargs = {} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2}
    return family.pipe(
        prompt=p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width,
        num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
        guidance_scale=p.cfg_scale if p.guided else 1.0,
        generator=[torch.Generator().manual_seed(p.seed)], max_sequence_length=family.max_sequence_length,
        output_type="np", **kwargs).frames


def test_wan_loop_equals_wan_pipeline_with_cfg(wan):
    p = params(wan, "a red circle", 3, negative_prompt="blurry", guidance_scale=4.0)
    assert p.guidance_mode == GuidanceMode.CFG and p.num_frames == 9
    ours = denoise_batch(wan, [p]).images[0]
    theirs = reference(wan, p)
    assert ours.shape == theirs.shape == (1, 9, 48, 64, 3)
    assert np.abs(ours - theirs).max() <= TOL


def test_a_video_preview_is_its_first_frame_decoded_alone(wan):
    """Wan's VAE is causal in time: the first latent frame decoded alone is the first frame of the
    whole decode, so a running video's preview costs a fraction of a decode; the loop sends one
    per ``partial_images`` step."""
    p = params(wan, "a red circle", 3, num_inference_steps=4, size="64x48")
    latents, _ = wan.prepare_latents([torch.Generator().manual_seed(3)], [1], p)
    whole, first = wan.decode(latents, p), wan.decode_preview(latents, p)
    assert first.shape == (1, 48, 64, 3) and np.abs(first - whole[:, 0]).max() <= 1e-5
    previews = []
    denoise_batch(wan, [dataclasses.replace(p, partial_images=2)],
                  on_preview=lambda index, k, images: previews.append((index, k, images.shape)))
    assert previews == [(0, 0, (1, 48, 64, 3)), (0, 1, (1, 48, 64, 3))]


def test_wan_batch_of_two_equals_each_alone(wan):
    a = params(wan, "a red circle", 1, guidance_scale=4.0)
    b = params(wan, "a blue square on a green background", 2, guidance_scale=4.0, negative_prompt="dark")
    out = denoise_batch(wan, [a, b]).images
    for p, frames in zip((a, b), out, strict=True):
        assert np.abs(frames - reference(wan, p)).max() <= TOL


def test_wan_without_guidance_runs_one_forward_per_step(wan):
    p = params(wan, "a red circle", 5, guidance_scale=1.0)
    assert not p.guided
    out = denoise_batch(wan, [p])
    assert out.calls == {"transformer": 6}
    assert np.abs(out.images[0] - reference(wan, p)).max() <= TOL


def test_boundary_experts_equal_wan22_pipeline(wan_moe):
    p = params(wan_moe, "a green star", 7, guidance_scale=4.0, guidance_scale_2=2.5, num_inference_steps=8)
    out = denoise_batch(wan_moe, [p])
    assert np.abs(out.images[0] - reference(wan_moe, p, guidance_scale_2=2.5)).max() <= TOL


@contextlib.contextmanager
def counting_forwards(family):
    """Yields {transformer name: forward calls} counted by hooks while the block runs."""
    counts = {name: 0 for name in family.transformers}
    hooks = [module.register_forward_hook(lambda *_, name=name: counts.__setitem__(name, counts[name] + 1))
             for name, module in family.transformers.items()]
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.875, 1.0])
def test_boundary_experts_run_the_expected_steps(wan_moe, ratio):
    p = params(wan_moe, "a green star", 7, guidance_scale=4.0, boundary_ratio=ratio, num_inference_steps=8)
    scheduler, timesteps = wan_moe.scheduler_and_timesteps(8, None)
    high = sum(float(t) >= ratio * 1000 for t in timesteps)
    with counting_forwards(wan_moe) as counts:
        out = denoise_batch(wan_moe, [p])
    assert counts == {"transformer": 2 * high, "transformer_2": 2 * (8 - high)}  # cond + uncond per step
    assert out.calls == {k: v for k, v in counts.items() if v}
    plan = step_plan(timesteps, p, DualMode.BOUNDARY, wan_moe.boundary_ratio)
    steps = steps_per_transformer(plan, 8)
    assert {k: len(v) for k, v in steps.items()} == {k: v // 2 for k, v in counts.items() if v}
    assert sorted(sum(steps.values(), [])) == list(range(8))  # the experts split the schedule
    if ratio == 1.0:
        assert high == 0  # every timestep is below 1000
    if ratio == 0.0:
        assert high == 8


def test_paired_per_step_calls_both_transformers_every_step(wan_paired):
    p = params(wan_paired, "a yellow ring", 11, guidance_scale=2.0, num_inference_steps=6)
    assert p.guidance_mode == GuidanceMode.AUTOGUIDANCE and p.negative_prompt is None
    with counting_forwards(wan_paired) as counts:
        out = denoise_batch(wan_paired, [p])
    assert counts == {"transformer": 6, "transformer_2": 6}
    assert out.images[0].shape == (1, 9, 48, 64, 3)
    # scale 1 means the guide cancels out: the result is transformer alone (still calling both).
    one = params(wan_paired, "a yellow ring", 11, guidance_scale=1.0, num_inference_steps=6)
    with counting_forwards(wan_paired) as counts:
        alone = denoise_batch(wan_paired, [one])
    assert counts == {"transformer": 6, "transformer_2": 6}
    assert not np.allclose(alone.images[0], out.images[0])


def test_paired_gating_skips_the_guide_after_the_gate(wan_paired):
    p = params(wan_paired, "a yellow ring", 11, guidance_scale=2.0, num_inference_steps=6, cfg_gate_step=0.5)
    with counting_forwards(wan_paired) as counts:
        out = denoise_batch(wan_paired, [p])
    assert gate_step(p, 6) == 3
    assert counts == {"transformer": 6, "transformer_2": 3} and out.cfg_reused_steps == 3


# -- Cache-DiT on both transformers ---------------------------------------------------------

def _contexts(transformer):
    contexts = cache_dit_compat.contexts(transformer)
    if not contexts:
        return None
    (context,) = contexts
    return context.cache_config


def _run(runner, p):
    return runner.run(batch_of(p))[0]


@pytest.fixture(scope="module")
def moe_runner():
    from pipeline.runner import BatchRunner

    return BatchRunner("tiny-wan-moe")


def test_dual_cache_dit_mount_refresh_unmount_with_secondary_inheritance(moe_runner):
    runner = moe_runner
    t1, t2 = runner.family.transformer, runner.family.transformer_2
    knobs = {"Fn_compute_blocks": 2, "residual_diff_threshold": 0.5, "scm_compute_bins": [3, 1, 2],
             "scm_cache_bins": [1, 1], "secondary": {"Fn_compute_blocks": 3}}
    p = params(runner.family, "a red circle", 1, guidance_scale=4.0, num_inference_steps=8, enable_cache_dit=True,
               cache_dit_params=knobs)
    out = _run(runner, p)
    high = len(runner.run_steps["transformer"])
    assert 0 < high < 8 and runner.run_steps["transformer_2"] == list(range(high, 8))
    c1, c2 = _contexts(t1), _contexts(t2)
    assert (c1.num_inference_steps, c2.num_inference_steps) == (high, 8 - high)  # split at the boundary
    assert (c1.Fn_compute_blocks, c2.Fn_compute_blocks) == (2, 3)  # the secondary's own knob
    assert c1.residual_diff_threshold == c2.residual_diff_threshold == 0.5  # inherited
    full = [1, 1, 1, 0, 1, 0, 1, 1]  # compute 3, cache 1, compute 1, cache 1, compute 2
    assert c1.steps_computation_mask == full[:high]
    assert c2.steps_computation_mask == [1, *full[high + 1:]]  # each expert's context starts computing
    assert c1.enable_separate_cfg and c2.enable_separate_cfg
    meta = out.acceleration.cache_dit.transformers
    assert {n: (m.transition, m.steps) for n, m in meta.items()} == {
        "transformer": ("mount", high), "transformer_2": ("mount", 8 - high)}

    # Same knobs, another boundary: a refresh of both contexts, sized for the new split, bins kept.
    q = params(runner.family, "a red circle", 1, guidance_scale=4.0, num_inference_steps=8, enable_cache_dit=True,
               cache_dit_params=knobs, boundary_ratio=0.5)
    _run(runner, q)
    high_q = len(runner.run_steps["transformer"])
    assert high_q != high and runner.last_transitions == {"transformer": "refresh", "transformer_2": "refresh"}
    assert (_contexts(t1).num_inference_steps, _contexts(t2).num_inference_steps) == (high_q, 8 - high_q)
    assert _contexts(t1).steps_computation_mask == full[:high_q]

    # Cache-DiT off: hooks leave both transformers, and the output is the exact one.
    exact = params(runner.family, "a red circle", 1, guidance_scale=4.0, num_inference_steps=8)
    plain = _run(runner, exact)
    assert not cache_dit_compat.is_mounted(t1) and not cache_dit_compat.is_mounted(t2)
    assert runner.last_transitions == {"transformer": "unmount", "transformer_2": "unmount"}
    from pipeline.families import load_family
    fresh = load_family("wan", ensure_tiny_wan(arch=TinyWanArch(dual="boundary")), torch_dtype=torch.float32,
                        device="cpu")
    assert plain.videos == _run_family(fresh, exact)


def test_a_boundary_that_leaves_the_primary_no_step_reports_it_computing_none(moe_runner):
    # boundary_ratio 1.0: every timestep is below the boundary, so transformer_2 runs all 8 steps
    p = params(moe_runner.family, "a red circle", 1, guidance_scale=4.0, num_inference_steps=8,
               enable_cache_dit=True, cache_dit_params={"Fn_compute_blocks": 2, "residual_diff_threshold": 0.5,
                                                         "max_warmup_steps": 2}, boundary_ratio=1.0)
    report = _run(moe_runner, p).acceleration.cache_dit
    assert moe_runner.run_steps == {"transformer_2": list(range(8))}
    assert (report.computed_steps, report.cached_steps) == (0, 0)  # the primary's: it ran no step
    second = report.transformers["transformer_2"]
    assert (second.steps, second.transition) == (8, "mount")
    assert second.cached_steps == 6  # each step past max_warmup_steps 2: the threshold 0.5 is far above the diffs
    assert report.transformers["transformer"].steps == 0 and not report.transformers["transformer"].active


def _run_family(family, p):
    from pipeline.media import encode_mp4

    return [encode_mp4(v, p.fps) for v in denoise_batch(family, [p]).images[0]]


def test_paired_cache_dit_secondary_uses_the_primary_config():
    from pipeline.runner import BatchRunner

    runner = BatchRunner("tiny-wan-paired")
    p = params(runner.family, "a yellow ring", 2, guidance_scale=2.0, num_inference_steps=8, enable_cache_dit=True,
               cache_dit_params={"Fn_compute_blocks": 1, "residual_diff_threshold": 0.3, "scm_preset": "fast"})
    out = _run(runner, p)
    c1, c2 = _contexts(runner.family.transformer), _contexts(runner.family.transformer_2)
    for field in ("num_inference_steps", "Fn_compute_blocks", "residual_diff_threshold", "steps_computation_mask"):
        assert getattr(c1, field) == getattr(c2, field), field
    assert c1.num_inference_steps == 8 and not c1.enable_separate_cfg and not c2.enable_separate_cfg
    assert out.acceleration.transformer_calls == {"transformer": 8, "transformer_2": 8}
    # CFG gating at 0.5: the guide transformer's context is sized for the 4 steps it still runs.
    gated = params(runner.family, "a yellow ring", 2, guidance_scale=2.0, num_inference_steps=8,
                   enable_cache_dit=True, cfg_gate_step=0.5,
                   cache_dit_params={"Fn_compute_blocks": 1, "residual_diff_threshold": 0.3, "scm_preset": "fast"})
    out = _run(runner, gated)
    assert _contexts(runner.family.transformer_2).num_inference_steps == 4
    assert out.acceleration.transformer_calls == {"transformer": 8, "transformer_2": 4}


def test_attention_override_flips_every_layer_of_both_experts(moe_runner):
    runner = moe_runner
    layers = runner.attention.layers
    per_transformer = [len([m for m in t.modules() if getattr(m, "processor", None) is not None
                            and diffusers_compat.has_backend_slot(m.processor)])
                       for t in runner.family.transformers.values()]
    assert len(layers) == sum(per_transformer) and min(per_transformer) == 20  # attn1 + attn2 x 10 blocks each
    exact = params(runner.family, "a red circle", 1, guidance_scale=4.0, num_inference_steps=4)
    math = params(runner.family, "a red circle", 1, guidance_scale=4.0, num_inference_steps=4,
                  attention_backend_override="torch_math")
    a = _run(runner, exact)
    b = _run(runner, math)
    assert {diffusers_compat.get_processor_backend(p) for p in layers} == {"_native_math"}
    assert b.acceleration.attention_backend == "torch_math"
    c = _run(runner, exact)
    assert {diffusers_compat.get_processor_backend(p) for p in layers} == {None}
    assert a.videos == c.videos  # back to the default kernel, byte-identical
    frames = [runner.denoise(batch_of(p)).images[0] for p in (exact, math)]
    assert np.abs(frames[0] - frames[1]).max() <= 1e-4  # math vs SDPA kernels: the same attention


def test_a_size_or_length_past_wans_position_table_is_refused_before_the_batch(wan):
    """``WanRotaryPosEmbed`` tables ``rope_max_seq_len`` (tiny: 256) positions per axis: with
    ``max_pixels`` 262144, 16x4112 passed the contract and failed its batch ("shape ... is
    invalid"), a 500. The facts carry max_side and max_latent_frames now; both are refused
    naming the field, the edges pass."""
    from pipeline.contract.videos import validate_video_request
    from pipeline.errors import InvalidRequestError
    from tests.helpers import wan_limits

    assert (wan.max_side, wan.max_latent_frames) == (256 * wan.spatial_factor, 256)
    limits = dataclasses.replace(wan_limits(wan), max_pixels=262144, max_frames=2000, max_side=wan.max_side,
                                 max_latent_frames=wan.max_latent_frames)
    late = params(wan, "a ball", 1, size="16x4096", num_frames=5, num_inference_steps=2)
    with pytest.raises(RuntimeError):  # what the batch met
        denoise_batch(wan, [dataclasses.replace(late, height=4112)])
    for body, field in (({"size": "16x4112"}, "size"), ({"size": "4112x16"}, "size"),
                        ({"num_frames": 1025}, "num_frames")):
        with pytest.raises(InvalidRequestError) as err:
            validate_video_request({"prompt": "a ball", **body}, limits)
        assert err.value.param == field and ("at most 4096 pixels" in str(err.value)
                                             or "at most 1021 frames" in str(err.value)), str(err.value)
    validate_video_request({"prompt": "a ball", "size": "16x4096", "num_frames": 1021}, limits)


def test_each_video_of_a_batch_keeps_its_own_fps(wan):
    """``fps`` is not in the signature (only the MP4 container's rate): a batch of two videos
    at 8 and 24 fps encodes each at its own (the batch's first request's was used for all)."""
    from pipeline.media import decode_mp4
    from pipeline.runner import BatchRunner
    from pipeline.signature import BatchSignature

    slow, fast = (dataclasses.replace(params(wan, "a yellow ring", 3 + i, num_inference_steps=2, fps=fps),
                                      request_id=f"fps{fps}") for i, fps in enumerate((8, 24)))
    assert BatchSignature.of(slow) == BatchSignature.of(fast)
    outputs = BatchRunner("tiny-wan").run(batch_of(slow, fast))
    assert [decode_mp4(out.videos[0])[1] for out in outputs] == [8.0, 24.0]


def test_the_same_frames_always_encode_to_the_same_mp4(wan):
    """helper-55: a Wan video sent twice alone came back with a frame off by 9–14 levels. The
    frames were equal; libx264's MB-tree rate control made the bytes depend on the process's
    heap. With it off, encoding the same frames gives the same bytes whatever ran before."""
    import random

    from pipeline.media import encode_mp4

    frames = denoise_batch(wan, [params(wan, "a red ball rolling", 2, num_frames=5, num_inference_steps=4,
                                        size="64x64")]).images[0][0]
    rng = random.Random(0)
    encoded = set()
    for _ in range(20):
        heap = [bytearray(rng.randint(1, 1 << 20)) for _ in range(rng.randint(1, 30))]
        for block in heap[::2]:
            block[:] = bytes([rng.randint(0, 255)]) * len(block)
        del heap[1::3]
        encoded.add(encode_mp4(frames, 8))
    assert len(encoded) == 1
