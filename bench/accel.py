"""Lossy accelerations on the embedded (trained) tiny-flux: denoise-time ratio and PSNR vs the exact output.

Each row runs the accelerated batch and the exact batch alternately (same prompt, seed and
size) and reports median denoise time ratio (exact / accelerated) and the PSNR of the
accelerated PNG against the exact PNG. Also the cost in ms of a Cache-DiT refresh and of a
remount at a batch boundary. The trained tiny-flux draws what it is asked at 64×64 (its
training size), so its residuals settle from step to step as a real model's do and
cache-dit's *dynamic* policy caches; static-policy rows show what the masks alone cost.

The dual-transformer rows run the embedded tiny Wan 2.2-style models (``tiny-wan-moe``:
boundary experts; ``tiny-wan-paired``: both transformers every step) on short videos and
compare the decoded frames (before MP4 encoding) with the exact ones.

The family rows run one block per further image family on its embedded tiny model
(``tiny-flux2``, ``tiny-qwen-image``, ``tiny-qwen-image-edit``, ``tiny-z-image``: random weights;
the edit model edits a drawn red circle, seen at ~1024x1024 pixels, so its time includes that
image's VAE encode) and draw each family's speed-vs-PSNR front (matplotlib,
``pip install -e '.[bench]'``) as ``bench/results/accel-<model>.png``.

    python bench/accel.py [--steps 28] [--size 64x64] [--iters 3] [--only flux|dual|families]
                          [--models tiny-qwen-image-edit ...]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline.cache_dit_params import CacheDiTParams  # noqa: E402
from pipeline.contract.base import cache_dit_problems, nothing_cached_problems  # noqa: E402
from pipeline.contract.images import validate_image_request  # noqa: E402
from pipeline.contract.limits import ServingLimits  # noqa: E402
from pipeline.contract.videos import validate_video_request  # noqa: E402
from pipeline.media import to_uint8  # noqa: E402
from pipeline.runner import BatchRunner  # noqa: E402
from pipeline.contract.edits import validate_edit_request  # noqa: E402
from pipeline.sampling import resolve, resolve_edit, resolve_video  # noqa: E402
from pipeline.signature import BatchSignature  # noqa: E402
from pipeline.state import CacheKey  # noqa: E402
from pipeline.wire import Batch  # noqa: E402


def drawn_circle() -> bytes:
    """A red circle on yellow (the tiny models' drawing), as PNG bytes."""
    import random

    from pipeline.tiny.data import Scene, draw

    out = io.BytesIO()
    draw(Scene("red", "circle", "yellow"), random.Random(0)).save(out, "PNG")
    return out.getvalue()


def psnr(a: bytes, b: bytes) -> float:
    x = np.asarray(Image.open(io.BytesIO(a)), dtype=np.float64)
    y = np.asarray(Image.open(io.BytesIO(b)), dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--size", default="64x64")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frames", type=int, default=17, help="frames of the dual-transformer videos")
    ap.add_argument("--video-size", default="64x64")
    ap.add_argument("--only", choices=("flux", "dual", "families"))
    ap.add_argument("--models", nargs="+", default=None, help="family rows of these embedded models only")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    if ns.only in (None, "flux"):
        flux_rows(ns)
    if ns.only in (None, "dual"):
        dual_rows(ns)
    if ns.only in (None, "families"):
        for model in ns.models or FAMILY_MODELS:
            family_rows(ns, model)


def alternate(runner, exact_b: Batch, accel_b: Batch, iters: int):
    """Run the exact and the accelerated batch alternately ``iters`` times after one warm-up
    round of each: (last exact output, last accelerated output, median denoise-time ratio)."""
    exact_ms, accel_ms = [], []
    for _ in range(iters + 1):  # first round warms both paths
        e = runner.run(exact_b)[0]
        a = runner.run(accel_b)[0]
        exact_ms.append(e.timings_ms["denoise"])
        accel_ms.append(a.timings_ms["denoise"])
    return e, a, statistics.median(exact_ms[1:]) / statistics.median(accel_ms[1:])


def flux_rows(ns) -> None:
    runner = BatchRunner("tiny-flux")
    limits = ServingLimits("tiny-flux", runner.facts().spatial_factor, 64, 64, ns.steps, 3.5,
                           max_pixels=1 << 22, num_blocks=runner.facts().num_blocks)

    def batch(body: dict) -> Batch:
        body = {"prompt": "a red circle on a blue background", "seed": 0, "size": ns.size,
                "num_inference_steps": ns.steps, **body}
        p = resolve(validate_image_request(body, limits), limits)
        return Batch("bench", BatchSignature.of(p), (p,))

    cfg = {"negative_prompt": "a blurry picture", "true_cfg_scale": 4.0}
    rows = [("DBCache defaults (dynamic)", {}, {"enable_cache_dit": True})]
    for preset in ("slow", "medium", "fast", "ultra"):
        rows.append((f"SCM {preset} (dynamic)", {}, {"enable_cache_dit": True, "cache_dit_params": {
            "scm_preset": preset}}))
    for preset in ("slow", "medium", "fast", "ultra"):
        rows.append((f"SCM {preset} (static)", {}, {"enable_cache_dit": True, "cache_dit_params": {
            "scm_preset": preset, "scm_policy": "static"}}))
    rows.append(("DBCache + TaylorSeer (dynamic)", {}, {"enable_cache_dit": True, "cache_dit_params": {
        "enable_taylorseer": True, "taylorseer_order": 1}}))
    rows.append(("SCM fast (static) + TaylorSeer", {}, {"enable_cache_dit": True, "cache_dit_params": {
        "scm_preset": "fast", "scm_policy": "static", "enable_taylorseer": True, "taylorseer_order": 1}}))
    rows.append(("DBCache Fn=1 (dynamic)", {}, {"enable_cache_dit": True, "cache_dit_params": {
        "Fn_compute_blocks": 1}}))
    rows.append(("DBCache Fn=1 + TaylorSeer (dynamic)", {}, {"enable_cache_dit": True, "cache_dit_params": {
        "Fn_compute_blocks": 1, "enable_taylorseer": True, "taylorseer_order": 1}}))
    rows.append(("DBCache Fn=1 thr=0.5 (dynamic)", {}, {"enable_cache_dit": True, "cache_dit_params": {
        "Fn_compute_blocks": 1, "residual_diff_threshold": 0.5, "max_warmup_steps": 4}}))
    rows.append(("Fn=1 thr=0.5 warmup 2 max 3 + TaylorSeer", {}, {"enable_cache_dit": True, "cache_dit_params": {
        "Fn_compute_blocks": 1, "residual_diff_threshold": 0.5, "max_warmup_steps": 2,
        "max_continuous_cached_steps": 3, "enable_taylorseer": True, "taylorseer_order": 1}}))
    rows.append(("CFG gating 0.5 (true CFG 4.0)", cfg, {"cfg_gate_step": 0.5}))

    print(f"tiny-flux {ns.size}, {ns.steps} steps, {ns.threads} threads, median of {ns.iters} alternated runs")
    print(f"{'setting':42s} {'speed':>7s} {'PSNR dB':>8s} {'cached':>7s} {'cfg reused':>10s}")
    for name, base, accel in rows:
        e, a, ratio = alternate(runner, batch(base), batch({**base, **accel}), ns.iters)
        meta = a.acceleration
        print(f"{name:42s} {ratio:6.2f}x {psnr(a.images[0], e.images[0]):8.1f} "
              f"{meta.cache_dit.cached_steps:4d}/{ns.steps:<2d} {meta.cfg_gate.reused_steps:10d}")

    # Cost of a state change at a batch boundary.
    key_a = CacheKey(CacheDiTParams(scm_preset="fast"), False)
    key_b = CacheKey(CacheDiTParams(scm_preset="slow"), False)
    executor, steps = runner.cache["transformer"], list(range(ns.steps))
    executor.mount(key_a, ns.steps, steps)
    refresh, remount = [], []
    for _ in range(10):
        t0 = time.perf_counter()
        executor.refresh(key_a, ns.steps, steps)
        refresh.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        executor.mount(key_b, ns.steps, steps, remount=True)
        executor.mount(key_a, ns.steps, steps, remount=True)
        remount.append((time.perf_counter() - t0) * 1e3 / 2)
    executor.unmount()
    print(f"Cache-DiT refresh at a batch boundary: {statistics.median(refresh):.2f} ms (median of 10)")
    print(f"Cache-DiT remount at a batch boundary: {statistics.median(remount):.2f} ms (median of 10)")


def frames_psnr(a: np.ndarray, b: np.ndarray) -> float:
    x, y = to_uint8(a).astype(np.float64), to_uint8(b).astype(np.float64)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def dual_rows(ns) -> None:
    """Cache-DiT on both transformers and CFG gating, for boundary experts and paired models."""
    secondary_strict = {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.5, "max_warmup_steps": 4,
                        "secondary": {"residual_diff_threshold": 0.05}}
    loose = {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.5, "max_warmup_steps": 4}
    models = {
        "tiny-wan-moe": [
            ("DBCache Fn=1 thr=0.5, both experts", {"enable_cache_dit": True, "cache_dit_params": loose}),
            ("  + secondary thr=0.05", {"enable_cache_dit": True, "cache_dit_params": secondary_strict}),
            ("SCM fast (static), both experts", {"enable_cache_dit": True, "cache_dit_params": {
                "scm_preset": "fast", "scm_policy": "static"}}),
            ("CFG gating 0.5", {"cfg_gate_step": 0.5}),
        ],
        "tiny-wan-paired": [
            ("DBCache Fn=1 thr=0.5, secondary=primary", {"enable_cache_dit": True, "cache_dit_params": loose}),
            ("SCM fast (static), secondary=primary", {"enable_cache_dit": True, "cache_dit_params": {
                "scm_preset": "fast", "scm_policy": "static"}}),
            ("guide gating 0.5 (skip transformer_2)", {"cfg_gate_step": 0.5}),
        ],
    }
    for model, rows in models.items():
        runner = BatchRunner(model)
        limits = runner.facts().limits(model, {
            "default_size": ns.video_size, "default_steps": ns.steps, "default_guidance_scale": 4.0, "max_n": 1,
            "max_pixels": 1 << 22, "max_steps": 100, "max_prompt_chars": 2000, "default_num_frames": ns.frames,
            "default_fps": 8, "max_frames": 1 << 10})

        def batch(body: dict, limits=limits) -> Batch:
            body = {"prompt": "a red circle on a blue background", "seed": 0, **body}
            p = resolve_video(validate_video_request(body, limits), limits)
            return Batch("bench", BatchSignature.of(p), (p,))

        print(f"\n{model} {ns.video_size} x {ns.frames} frames, {ns.steps} steps, guidance 4.0, "
              f"{ns.threads} threads, median of {ns.iters} alternated runs")
        print(f"{'setting':40s} {'speed':>7s} {'PSNR dB':>8s} {'cached steps per transformer':>30s}")
        exact_b = batch({})
        for name, accel in rows:
            accel_b = batch(accel)
            exact_ms, accel_ms = [], []
            for _ in range(ns.iters + 1):  # first round warms both paths
                e = runner.denoise(exact_b)
                a = runner.denoise(accel_b)
                exact_ms.append(e.denoise_ms)
                accel_ms.append(a.denoise_ms)
            cached = {name: executor.cached_steps() for name, executor in runner.cache.items()}
            ran = {k: len(v) for k, v in runner.run_steps.items()}
            ratio = statistics.median(exact_ms[1:]) / statistics.median(accel_ms[1:])
            detail = ", ".join(f"{k} {cached[k]}/{ran.get(k, 0)}" for k in cached)
            print(f"{name:40s} {ratio:6.2f}x {frames_psnr(a.images[0], e.images[0]):8.1f} {detail:>30s}")


# one block per further image family's embedded model
FAMILY_MODELS = ("tiny-flux2", "tiny-qwen-image", "tiny-qwen-image-edit", "tiny-z-image")
RESULTS = Path(__file__).resolve().parent / "results"


def family_rows(ns, model: str) -> None:
    """The accelerations every image family takes, on ``model``: speed ratio and PSNR per row,
    and the speed-vs-PSNR front drawn to ``bench/results/accel-<model>.png``."""
    runner = BatchRunner(model)
    facts = runner.facts()
    limits = facts.limits(model, {"default_size": ns.size, "default_steps": ns.steps, "default_guidance_scale": 4.0,
                                  "max_n": 1, "max_pixels": 1 << 22, "max_steps": 100, "max_prompt_chars": 2000,
                                  "default_num_frames": 1, "default_fps": 8, "max_frames": 1})

    image = io.BytesIO()  # what an edit model edits (requires_image): a drawn red circle
    Image.open(io.BytesIO(drawn_circle())).resize(tuple(int(v) for v in ns.size.split("x"))).save(image, "PNG")

    def batch(body: dict) -> Batch:
        body = {"prompt": "a red circle on a blue background", "seed": 0, "num_inference_steps": ns.steps, **body}
        if facts.requires_image:
            p = resolve_edit(validate_edit_request({**body, "image": image.getvalue()}, limits), limits)
        else:
            p = resolve(validate_image_request(body, limits), limits)
        return Batch("bench", BatchSignature.of(p), (p,))

    from pipeline.modes import GuidanceMode

    true_cfg = runner.family.guidance_style == GuidanceMode.TRUE_CFG
    cfg = {"negative_prompt": "a blurry picture", **({"true_cfg_scale": 4.0} if true_cfg else {"guidance_scale": 4.0})}
    cfg_name = "true CFG 4.0" if true_cfg else "CFG 4.0"
    # cache-dit's defaults compute Fn=8 blocks every step: on a model with fewer blocks (the
    # 4-block tiny-qwen-image-edit), or with none left to cache, they are a 400, so there the SCM
    # rows compute Fn=1 and the row of DBCache's defaults is left out (the server's own rule)
    defaults = CacheDiTParams()
    few = bool(cache_dit_problems(defaults, limits, None) + nothing_cached_problems(defaults, limits, None))
    fn = {"Fn_compute_blocks": 1} if few else {}
    suffix = ", Fn=1" if few else ""
    if few:
        print(f"{model}: {facts.num_blocks} transformer blocks, none left to cache by cache-dit's default "
              f"Fn_compute_blocks=8: no row for DBCache defaults, SCM rows with Fn=1")
    rows = [*([] if few else [("DBCache defaults (dynamic)", {}, {"enable_cache_dit": True})]),
            ("DBCache Fn=1 thr=0.5 (dynamic)", {}, {"enable_cache_dit": True, "cache_dit_params": {
                "Fn_compute_blocks": 1, "residual_diff_threshold": 0.5, "max_warmup_steps": 4}}),
            *((f"SCM {preset} (static{suffix})", {}, {"enable_cache_dit": True, "cache_dit_params": {
                "scm_preset": preset, "scm_policy": "static", **fn}}) for preset in ("medium", "fast", "ultra")),
            (f"CFG gating 0.5 ({cfg_name})", cfg, {"cfg_gate_step": 0.5}),
            (f"CFG gating 0.25 ({cfg_name})", cfg, {"cfg_gate_step": 0.25})]
    print(f"\n{model} ({facts.family}) {ns.size}, {ns.steps} steps, {ns.threads} threads, "
          f"median of {ns.iters} alternated runs")
    print(f"{'setting':42s} {'speed':>7s} {'PSNR dB':>8s} {'cached':>7s} {'cfg reused':>10s}")
    points = []
    for name, base, accel in rows:
        e, a, ratio = alternate(runner, batch(base), batch({**base, **accel}), ns.iters)
        quality = psnr(a.images[0], e.images[0])
        points.append((name, ratio, quality))
        meta = a.acceleration
        print(f"{name:42s} {ratio:6.2f}x {quality:8.1f} {meta.cache_dit.cached_steps:4d}/{ns.steps:<2d} "
              f"{meta.cfg_gate.reused_steps:10d}")
    plot_front(model, points, ns)


def plot_front(model: str, points: list[tuple[str, float, float]], ns) -> None:
    """Speed ratio (x) against PSNR (y) of each setting, the Pareto front joined, to a PNG."""
    try:
        import matplotlib
    except ImportError:
        print("(matplotlib is not installed: pip install -e '.[bench]' to draw the front)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [(n, r, min(q, 99.0)) for n, r, q in points]
    front, best = [], -1.0
    for name, ratio, quality in sorted(finite, key=lambda p: (-p[2], -p[1])):
        if ratio > best:
            front.append((ratio, quality))
            best = ratio
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ratio, quality in finite:
        ax.scatter(ratio, quality, color="tab:blue")
        ax.annotate(name, (ratio, quality), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.plot(*zip(*sorted(front)), color="tab:orange", label="Pareto front")
    ax.set_xlabel("denoise speed vs exact (x)")
    ax.set_ylabel("PSNR vs exact (dB)")
    ax.set_title(f"{model}: {ns.size}, {ns.steps} steps, {ns.threads} CPU threads")
    ax.legend()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"accel-{model}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"front drawn to {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")


if __name__ == "__main__":
    main()
