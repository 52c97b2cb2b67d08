"""The first GPU run: every GPU-readiness check that a CPU cannot show, in one command.

    .venv/bin/python bench/gpu/check.py [--device cuda] [--only kernels,attention,...] [--scale full|tiny]

Each check prints one progress line as it ends; at the end the script prints one table (check,
configuration, figures, status: ``PASS``/``FAIL``/``SKIP``) and, on CUDA, writes every figure to
``bench/gpu/results.json`` (the date, the GPU, torch / diffusers / cache-dit versions; ``--results
PATH`` writes elsewhere, also from a CPU run). It exits 1 when any check fails. Nothing is
downloaded: the tiny checks use the embedded tiny-flux, the large ones FLUX.1-dev- and Wan 2.1
14B-sized transformers built from their published configs with random weights, in bf16.

Budget: all checks together take at most 8 minutes on one H100 / H200 (figures in brackets:
estimates per check, not yet measured; ``ranks`` runs only with a second GPU). Items in
parentheses refer to the GPU-readiness issue (19); the CPU suite proves the rest
(tests/test_kernels.py, tests/test_faults.py, tests/test_parallel.py).

- ``kernels`` (4) [20 s]: every attention kernel the replica accepts runs a request; every one it
  refuses names why (installed versions printed).
- ``default-kernel`` (5) [5 s]: a replica refuses to start with ``attention_backend: fa`` in float32.
- ``ring-lse`` (6) [5 s]: ring merges (yunchang's ``update_out_and_lse``) of two key blocks with
  the LSE of torch's CUDA memory-efficient kernel (sliced and upcast) and of flash-attn equal
  attention over all keys; the raw padded LSE fails to merge.
- ``timings`` (9) [10 s]: a batch's ``denoise`` time against the wall time around it, synced after
  and with no decode to hide unfinished steps (with the loop's ``torch.cuda.synchronize`` before
  its clock stops they agree; without it ``denoise`` undercounts).
- ``memory`` (11) [15 s]: GPU bytes of a rank that loads the transformers alone against rank 0,
  host memory while loading straight to the GPU, and the decode peak with VAE slicing.
- ``batch-invariance`` (12) [10 s]: bf16 pixels of a request alone against the same request in a
  batch of 4: within the README's bound (``BATCH_INVARIANCE_MAX_LEVELS``, 8 of 255 levels).
- ``ranks`` (6, 8, 11; 2+ GPUs) [60 s]: two rank actors get different GPUs, and a 2-rank Ulysses
  and ring replica equal one rank.

The large checks call the transformers directly with random inputs: FLUX.1-dev at 1024x1024
(4096 image + 512 text tokens, guidance 3.5) and Wan 2.1 T2V 14B at 33 frames 480x832 (14040
video + 512 text tokens; 81 frames would not fit the budget). Each configuration's peak is
``torch.cuda.max_memory_allocated`` (weights included), reset before it; times come from CUDA
events: forwards are means after a warm-up forward, 28-step runs are timed once.

- ``attention`` [90 s]: every kernel of ``parallel.kernels.KERNELS`` on both models, switched per
  layer by ``pipeline.attention.AttentionSwitch``, against ``torch_sdpa``: ms per forward, speed
  ratio, max |difference| of the output. A kernel this replica would refuse is a SKIP row with
  the project's own reasons (``replica_kernel_rejections``); one that runs out of memory (exact
  math attention on Wan materialises the score matrix) is a SKIP row saying so.
- ``batch`` [20 s]: FLUX forwards at batch 1 and 4: images/s (28 steps) and their ratio; the bf16
  difference of a request's output alone and in the batch.
- ``cache-dit`` [60 s]: 28 Euler steps of FLUX without Cache-DiT, then with DBCache mounted by
  ``pipeline.cache_dit_actions.CacheDiTExecutor`` (Fn 8, Bn 0, warm-up 4): the dynamic policy at
  ``residual_diff_threshold`` 0.08 (random weights change their residuals between steps far more
  than a trained model, so it may cache nothing), the dynamic policy at 1.5x the median residual
  change that run measured (so it caches), and the ``medium`` step-computation mask under the
  static policy. Cached steps, ms per image, speed-up, difference from the uncached latents.
- ``compile`` [160 s]: torch.compile (inductor, cache-dit's settings) after the Cache-DiT mount
  (the dynamic policy that caches), as the replica does (``configure_compile``,
  ``module.compile``): graphs compiled by the first 28-step run and by a second one
  (``compat.torch.dynamo_counts``; the second must compile none and no frame may hit the
  recompile limit), the first run's seconds, compiled against eager ms per image.
- ``offload`` [40 s]: the added time of ``model.offload``: a FLUX-sized forward under diffusers'
  group offloading against the resident one (ms per forward and per 28-step image, peak bytes),
  and an idle-expert swap (a Wan-sized expert to host memory and back; a request pays it twice).
- ``serve`` [60 s]: ``serve run`` of configs/tiny-cpu.yaml moved to the device (a temporary copy,
  its own local Ray cluster and port), one ``POST /v1/images/generations`` that must return a
  PNG, then SIGINT and a bounded wait for the shutdown.

``--device cpu`` runs what applies on CPU (a smoke test of this script, about 3 minutes): the
large checks run at ``--scale tiny`` (2 + 4 FLUX blocks, 2 Wan blocks, 2 heads of 16, small
images), torch.compile with the ``eager`` backend, and no results file unless ``--results``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

RESULTS_PATH = Path(__file__).resolve().parent / "results.json"


@dataclass
class Row:
    """One line of the final table: a check, the configuration it measured, its figures
    (raw numbers, units in the key: ``_ms`` milliseconds, ``_s`` seconds, ``_bytes`` bytes,
    ``_x`` a ratio) and its status."""

    check: str
    configuration: str
    figures: dict = field(default_factory=dict)
    status: str = "PASS"


ROWS: list[Row] = []
SCALE = "full"  # "full": published sizes; "tiny": the CPU smoke sizes (set by main)


class Skip(Exception):
    """A check that does not apply here (no CUDA, one GPU, a package not installed)."""


def _runner(device: str, dtype: str = "bfloat16", **kwargs):
    from pipeline.runner import BatchRunner

    return BatchRunner("tiny-flux", dtype=dtype, device=device, **kwargs)


def _params(runner, bodies: list[dict]):
    from deployments.config import LimitsConfig
    from pipeline.contract.images import validate_image_request
    from pipeline.sampling import resolve
    from pipeline.signature import BatchSignature
    from pipeline.wire import Batch

    limits = runner.facts().limits("tiny-flux", {**LimitsConfig().model_dump(), "max_pixels": 2048 * 2048})
    params = tuple(resolve(validate_image_request(b, limits), limits) for b in bodies)
    return Batch("gpu-check", BatchSignature.of(params[0]), params)


def _pixels(png: bytes) -> np.ndarray:
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


BODY = {"prompt": "a red circle on a blue background", "seed": 7, "num_inference_steps": 4, "size": "256x256"}


def check_kernels(device: str) -> str:
    from parallel.kernels import DISTRIBUTIONS, KERNELS, installed_version

    versions = {d: installed_version(p) for p, d in DISTRIBUTIONS.items()}
    runner = _runner(device)
    rejections = runner.facts().attention_rejections
    ran, refused, failed = [], [], []
    for name in KERNELS:
        if rejections.get(name):
            refused.append(f"{name} ({'; '.join(rejections[name])})")
            continue
        try:
            (out,) = runner.run(_params(runner, [{**BODY, "attention_backend_override": name}]))
            assert out.images and out.error is None
            ran.append(name)
        except Exception as exc:  # noqa: BLE001 - an accepted kernel that fails is the finding
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    detail = f"installed {versions}; ran {ran}; refused {refused}"
    if failed:
        raise AssertionError(f"accepted but failed: {failed}; {detail}")
    return detail


def check_default_kernel(device: str) -> str:
    try:
        _runner(device, dtype="float32", attention_backend="fa")
    except ValueError as exc:
        return f"refused at startup: {exc}"
    raise AssertionError("a float32 replica started with attention_backend fa")


def _blocks_merged(attention, q, k, v) -> float:
    """Max |ring merge of two key blocks - attention over all keys| (float32 reference)."""
    from yunchang.ring.utils import update_out_and_lse

    from parallel.attention import lse_math_attention

    half = k.shape[1] // 2
    out = lse = None
    for block in (slice(0, half), slice(half, None)):
        block_out, block_lse = attention(q, k[:, block], v[:, block])
        out, lse = update_out_and_lse(out, lse, block_out, block_lse)
    reference, _ = lse_math_attention(q.float(), k.float(), v.float())
    return (out - reference).abs().max().item()


def check_ring_lse(device: str) -> str:
    if not device.startswith("cuda"):
        raise Skip("the padded LSE is CUDA's")
    from compat.torch import efficient_attention
    from parallel.attention import efficient_attention_lse

    torch.manual_seed(0)
    figures = []
    for seq in (40, 64, 1000):  # per-rank query counts, multiple of 32 or not
        q, k, v = (torch.randn(2, seq, 8, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
        k, v = torch.cat([k, k.flip(1)], 1), torch.cat([v, v.flip(1)], 1)
        err = _blocks_merged(efficient_attention_lse, q, k, v)
        assert err < 2e-2, f"torch_sdpa ring merge error {err:.2e} at {seq} queries"
        figures.append(f"torch_sdpa S={seq}: {err:.1e}")
        if seq % 32:
            def raw(q_, k_, v_):  # what yunchang's TORCH_EFFICIENT passes on: padded, in bf16
                out, lse = efficient_attention(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2))
                return out.transpose(1, 2), lse.to(q_.dtype)
            try:
                _blocks_merged(raw, q, k, v)
                figures.append(f"raw padded LSE S={seq}: merged (unexpected)")
            except RuntimeError:
                figures.append(f"raw padded LSE S={seq}: fails to merge (as predicted)")
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            continue

        def fa(q_, k_, v_):
            out, lse, _ = flash_attn_func(q_, k_, v_, return_attn_probs=True)
            return out, lse

        err = _blocks_merged(fa, q, k, v)
        assert err < 2e-2, f"fa ring merge error {err:.2e} at {seq} queries"
        figures.append(f"fa S={seq}: {err:.1e}")
    return "; ".join(figures)


def check_timings(device: str) -> str:
    """``denoise_ms`` is the GPU's time, not the host's time to queue the kernels: the loop
    synchronizes before it stops the clock. Timed with no decode after it (a decode's copy to the
    host would wait for unfinished steps and hide a missing sync), the call's wall time, synced
    after, must be ``denoise_ms`` plus the few host milliseconds the loop does not count."""
    from pipeline.loop import denoise_batch

    runner = _runner(device)
    size = "1024x1024" if device.startswith("cuda") else "128x128"  # CPU: a smoke run
    requests = list(_params(runner, [{**BODY, "size": size, "num_inference_steps": 8, "seed": s}
                                     for s in (1, 2)]).requests)
    denoise_batch(runner.family, requests, decode=False)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    out = denoise_batch(runner.family, requests, decode=False)
    _sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    ratio = out.denoise_ms / wall_ms  # without the loop's sync: the steps' GPU time falls outside
    detail = f"denoise_ms {out.denoise_ms:.1f} of {wall_ms:.1f} ms wall, synced after (ratio {ratio:.3f})"
    assert 0.9 <= ratio <= 1.0, detail
    return detail


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def check_memory(device: str) -> str:
    if not device.startswith("cuda"):
        raise Skip("GPU memory")
    from pipeline.families import load_family
    from pipeline.tiny.registry import EMBEDDED

    path = EMBEDDED["tiny-flux"].build()
    figures = []
    for components in ("all", "denoiser"):
        torch.cuda.empty_cache()
        before, rss = torch.cuda.memory_allocated(), _rss_mib()
        family = load_family("flux", path, torch_dtype=torch.bfloat16, device=device, components=components)
        figures.append(f"{components}: {(torch.cuda.memory_allocated() - before) / 2**20:.1f} MiB on GPU, "
                       f"{family.parameter_bytes() / 2**20:.1f} MiB weights, host +{_rss_mib() - rss:.0f} MiB")
        del family
    peaks = {}
    for slicing in (False, True):
        family = load_family("flux", path, torch_dtype=torch.bfloat16, device=device, vae_slicing=slicing)
        runner = _runner(device)
        params = _params(runner, [{**BODY, "size": "1024x1024", "n": 4}]).requests[0]
        latents, _ = family.prepare_latents([torch.Generator("cpu").manual_seed(i) for i in range(4)], [1] * 4,
                                            params)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        family.decode(latents, params)
        peaks[slicing] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del family, runner
    figures.append(f"decode peak n=4 1024x1024: {peaks[False]:.0f} MiB, sliced {peaks[True]:.0f} MiB")
    assert peaks[True] < peaks[False], figures[-1]
    return "; ".join(figures)


BATCH_INVARIANCE_MAX_LEVELS = 8  # the bound README ("What ditserve promises about pixels") states; CPU bf16: 4


def check_batch_invariance(device: str) -> str:
    runner = _runner(device)
    others = [{**BODY, "prompt": p, "seed": s} for s, p in ((11, "a green star"), (12, "two squares"),
                                                            (13, "a yellow triangle at night"))]
    alone = _pixels(runner.run(_params(runner, [BODY]))[0].images[0])
    batched = _pixels(runner.run(_params(runner, [BODY, *others]))[0].images[0])
    diff = np.abs(alone - batched)
    detail = f"bf16 alone vs in a batch of 4: max {diff.max()} levels, mean {diff.mean():.3f} (0-255)"
    assert diff.max() <= BATCH_INVARIANCE_MAX_LEVELS, f"{detail}: past the README's {BATCH_INVARIANCE_MAX_LEVELS}"
    return detail


def check_ranks(device: str) -> str:
    if not device.startswith("cuda") or torch.cuda.device_count() < 2:
        raise Skip("needs 2 GPUs")
    import ray

    from deployments.rank_worker import RankWorker
    from parallel.groups import free_port

    ray.init(num_gpus=2, include_dashboard=False)
    figures = []
    single = _runner(device)
    batch = _params(single, [{**BODY, "seed": 3}, {**BODY, "seed": 4, "prompt": "a green star"}])
    reference = single.denoise(batch)
    del single
    torch.cuda.empty_cache()
    for layout in ({"ulysses_degree": 2, "ring_degree": 1}, {"ulysses_degree": 1, "ring_degree": 2}):
        workers = [RankWorker.options(num_gpus=1).remote(r, {"name": "tiny-flux", "dtype": "bfloat16", "device": "cuda"},
                                                         {}, layout, None) for r in range(2)]
        try:
            weights = ray.get([w.ready.remote() for w in workers])
            port = free_port()
            ray.get([w.join.remote("127.0.0.1", port) for w in workers])
            devices = ray.get([w.__ray_call__.remote(lambda self: (str(self.runner.family.device), ray.get_gpu_ids()))
                               for w in workers])
            assert devices[0][1] != devices[1][1], f"ranks share a GPU: {devices}"
            out = ray.get([w.denoise.remote(batch) for w in workers])[0]
            diff = max(np.abs(a.astype(np.float32) - b.astype(np.float32)).max()
                       for a, b in zip(reference.images, out.images, strict=True))
            figures.append(f"{layout}: ranks on {devices}, weights {weights} bytes, max |sp - single| {diff:.3f}")
            assert weights[1] < weights[0] and diff <= 0.05, figures[-1]
        finally:
            for w in workers:
                ray.kill(w)
    return "; ".join(figures)


# -- the large checks: published-size transformers with random weights -------------------------

# diffusers' FluxTransformer2DModel as in black-forest-labs/FLUX.1-dev transformer/config.json
FLUX_DEV = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
            "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
            "guidance_embeds": True, "axes_dims_rope": (16, 56, 56)}
# diffusers' WanTransformer3DModel as in Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json
WAN_T2V_14B = {"patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
               "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
               "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
               "added_kv_proj_dim": None, "rope_max_seq_len": 1024}
# --scale tiny: the same code paths at smoke-test sizes (rope axes sum to the head dim)
TINY = {"flux": {"num_layers": 2, "num_single_layers": 4, "attention_head_dim": 16, "num_attention_heads": 2,
                 "joint_attention_dim": 32, "pooled_projection_dim": 16, "axes_dims_rope": (4, 6, 6)},
        "wan": {"num_attention_heads": 2, "attention_head_dim": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 64,
                "num_layers": 2}}
# pixels (and frames) of the inputs, and text tokens
SHAPES = {"full": {"flux": {"height": 1024, "width": 1024, "text": 512},
                   "wan": {"frames": 33, "height": 480, "width": 832, "text": 512}},
          "tiny": {"flux": {"height": 256, "width": 256, "text": 32},
                   "wan": {"frames": 5, "height": 64, "width": 64, "text": 16}}}
STEPS = 28  # FLUX.1-dev's default, and what cache-dit's step-computation masks are tuned on
GUIDANCE = 3.5
MODELS: dict[str, torch.nn.Module] = {}  # at most one large transformer at a time


def _build(family: str, device: str) -> torch.nn.Module:
    """A FLUX.1-dev (``family="flux"``) or Wan 2.1 T2V 14B (``"wan"``) transformer with random
    weights (seed 0), built directly on ``device`` in bfloat16. Parameters that diffusers'
    ``from_pretrained`` keeps in float32 (``_keep_in_fp32_modules``) are float32 here too."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    cls, config = {"flux": (FluxTransformer2DModel, FLUX_DEV), "wan": (WanTransformer3DModel, WAN_T2V_14B)}[family]
    if SCALE == "tiny":
        config = {**config, **TINY[family]}
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16: no float32 copy of 12-14 B parameters
    try:
        with torch.device(device):
            model = cls(**config)
    finally:
        torch.set_default_dtype(previous)
    keep = model._keep_in_fp32_modules or []
    for name, parameter in model.named_parameters():
        if any(k in name for k in keep):
            parameter.data = parameter.data.float()
    return model.eval().requires_grad_(False)


def _model(family: str, device: str) -> torch.nn.Module:
    """The cached transformer of ``family``, built after dropping any other (GPU memory)."""
    if family not in MODELS:
        _drop_models(device)
        t0 = time.perf_counter()
        MODELS[family] = _build(family, device)
        size = sum(p.numel() for p in MODELS[family].parameters())
        print(f"  built {_describe(family)}: {size:,} parameters in {time.perf_counter() - t0:.1f} s", flush=True)
    return MODELS[family]


def _drop_models(device: str) -> None:
    MODELS.clear()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _describe(family: str) -> str:
    """The model and input size, e.g. ``FLUX.1-dev 1024x1024 (4096+512 tokens)``."""
    shape = SHAPES[SCALE][family]
    tiny = " (tiny)" if SCALE == "tiny" else ""
    if family == "flux":
        tokens = (shape["height"] // 16) * (shape["width"] // 16)
        return f"FLUX.1-dev{tiny} {shape['height']}x{shape['width']} ({tokens}+{shape['text']} tokens)"
    tokens = ((shape["frames"] - 1) // 4 + 1) * (shape["height"] // 16) * (shape["width"] // 16)
    return f"Wan2.1-14B{tiny} {shape['frames']}x{shape['height']}x{shape['width']} ({tokens}+{shape['text']} tokens)"


def _inputs(family: str, model: torch.nn.Module, batch: int, device: str) -> dict:
    """Random forward inputs (seed 1) shaped as the family's pipeline shapes them.

    FLUX: ``hidden_states`` (B, H/16 * W/16, 64) packed latents, ``encoder_hidden_states``
    (B, 512, 4096) T5 text, ``pooled_projections`` (B, 768) CLIP, ``timestep`` and ``guidance``
    (B,) (the pipeline's t/1000 and guidance scale), ``img_ids`` (H/16 * W/16, 3) latent-grid
    positions, ``txt_ids`` (512, 3) zeros. Wan: ``hidden_states`` (B, 16, (F-1)/4+1, H/8, W/8)
    latents, ``timestep`` (B,) in [0, 1000], ``encoder_hidden_states`` (B, 512, 4096) UMT5 text.
    All bfloat16 except the position ids (float32).
    """
    shape, config = SHAPES[SCALE][family], model.config
    g = torch.Generator("cpu").manual_seed(1)

    def randn(*size):
        return torch.randn(*size, generator=g).to(device=device, dtype=torch.bfloat16)

    if family == "flux":
        h, w = shape["height"] // 16, shape["width"] // 16
        ids = torch.zeros(h, w, 3)
        ids[..., 1] += torch.arange(h)[:, None]
        ids[..., 2] += torch.arange(w)[None, :]
        return {"hidden_states": randn(batch, h * w, config.in_channels),
                "encoder_hidden_states": randn(batch, shape["text"], config.joint_attention_dim),
                "pooled_projections": randn(batch, config.pooled_projection_dim),
                "timestep": torch.full((batch,), 1.0, device=device, dtype=torch.bfloat16),
                "guidance": torch.full((batch,), GUIDANCE, device=device, dtype=torch.bfloat16),
                "img_ids": ids.reshape(h * w, 3).to(device), "txt_ids": torch.zeros(shape["text"], 3, device=device)}
    frames = (shape["frames"] - 1) // 4 + 1
    return {"hidden_states": randn(batch, config.in_channels, frames, shape["height"] // 8, shape["width"] // 8),
            "timestep": torch.full((batch,), 500.0, device=device, dtype=torch.bfloat16),
            "encoder_hidden_states": randn(batch, shape["text"], config.text_dim)}


def _forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """One transformer forward: the prediction, shaped as ``inputs["hidden_states"]``."""
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def _flux_denoise(model: torch.nn.Module, inputs: dict, steps: int = STEPS) -> torch.Tensor:
    """``steps`` Euler steps of the flow-matching ODE from ``inputs["hidden_states"]``, sigmas
    linear from 1 to 0 (one forward per step, as a guidance-distilled FLUX.1-dev pipeline):
    the final latents (B, tokens, 64) bfloat16."""
    latents = inputs["hidden_states"]
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    for i in range(steps):
        t = torch.full_like(inputs["timestep"], sigmas[i])
        velocity = _forward(model, {**inputs, "hidden_states": latents, "timestep": t})
        latents = latents + (sigmas[i + 1] - sigmas[i]) * velocity
    return latents


def _measure(fn, device: str, repeats: int = 1, warmup: int = 0):
    """Call ``fn`` ``warmup`` times, then ``repeats`` times timed: ``(last output, mean ms per
    call, peak bytes)``. On CUDA the time is from CUDA events and the peak is
    ``torch.cuda.max_memory_allocated`` over the timed calls (reset first; allocated weights
    included); on CPU the time is wall-clock and the peak None."""
    for _ in range(warmup):
        fn()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    if cuda:
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end) / repeats, torch.cuda.max_memory_allocated()
    return out, (time.perf_counter() - t0) * 1e3 / repeats, None


def _diff(out: torch.Tensor, reference: torch.Tensor) -> dict:
    """``max_abs_diff`` and ``rel_max_diff`` (max |out - reference| / max |reference|), float32."""
    d = (out.float() - reference.float()).abs().max().item()
    return {"max_abs_diff": d, "rel_max_diff": d / max(reference.float().abs().max().item(), 1e-12)}


def _finite(out: torch.Tensor, what: str) -> None:
    if not torch.isfinite(out).all():
        raise AssertionError(f"{what}: non-finite output")


def _row(check: str, configuration: str, figures: dict, status: str = "PASS") -> Row:
    row = Row(check, configuration, figures, status)
    ROWS.append(row)
    print(f"  {status} {configuration}: {_format(figures)}", flush=True)
    return row


def _failed_rows(check: str) -> None:
    failed = [r.configuration for r in ROWS if r.check == check and r.status == "FAIL"]
    if failed:
        raise AssertionError(f"{len(failed)} configuration(s) failed: {'; '.join(failed)}")


REL_BOUND = {True: 0.1, False: 0.5}  # rel_max_diff vs torch_sdpa of an exact / a quantised kernel
REPEATS = {"full": {"flux": 3, "wan": 2}, "tiny": {"flux": 1, "wan": 1}}


def check_attention(device: str) -> str:
    """Every registry kernel against ``torch_sdpa`` on FLUX- and Wan-sized transformers: rows
    of ms per forward, speed ratio (SDPA ms / kernel ms), max and relative difference of the
    output, peak bytes; refused kernels are SKIP rows with the replica's reasons."""
    from parallel.kernels import KERNELS
    from pipeline.attention import AttentionSwitch, replica_kernel_rejections

    ran = []
    for family in ("flux", "wan"):
        model = _model(family, device)
        switch = AttentionSwitch([model])
        inputs = _inputs(family, model, 1, device)
        reference = sdpa_ms = None
        for name in ("torch_sdpa", *(n for n in KERNELS if n != "torch_sdpa")):
            configuration = f"{_describe(family)}, {name}"
            reasons = replica_kernel_rejections(name, device=torch.device(device), dtype=torch.bfloat16,
                                                torch_compile=False, num_layers=len(switch.layers))
            if reasons:
                _row("attention", configuration, {"reason": "; ".join(reasons)}, "SKIP")
                continue
            try:
                switch.apply(switch.prepare(name))
                out, ms, peak = _measure(lambda: _forward(model, inputs), device,
                                         repeats=REPEATS[SCALE][family], warmup=1)
            except torch.cuda.OutOfMemoryError as exc:
                _row("attention", configuration, {"reason": f"out of memory at this size: {str(exc)[:120]}"}, "SKIP")
                continue
            except Exception as exc:  # noqa: BLE001 - an accepted kernel that fails is the finding
                _row("attention", configuration, {"error": f"{type(exc).__name__}: {exc}"}, "FAIL")
                continue
            finally:
                switch.apply(None)
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            figures = {"forward_ms": ms}
            if name == "torch_sdpa":
                reference, sdpa_ms = out, ms
            elif reference is not None:  # else SDPA itself failed: nothing to compare with
                figures.update({"speed_vs_sdpa_x": sdpa_ms / ms, **_diff(out, reference)})
            figures["peak_bytes"] = peak
            bound = REL_BOUND[KERNELS[name].exact]
            ok = torch.isfinite(out).all().item() and figures.get("rel_max_diff", 0.0) <= bound
            _row("attention", configuration, figures, "PASS" if ok else "FAIL")
            ran.append(f"{family}:{name}")
            del out
        model = switch = inputs = reference = None  # before the next family is built: one on the GPU at a time
    _failed_rows("attention")
    return f"ran {ran}"


def check_batch(device: str) -> str:
    """FLUX forwards at batch 1 and 4: rows of ms per forward, images/s (the transformer's
    share of a 28-step image: no text encoding, no decoding), peak bytes; the batch-4 row adds
    its throughput ratio and the difference of request 0's output from the same request alone
    (bf16 kernels may pick other tilings per batch size)."""
    model = _model("flux", device)
    figures_by_batch = {}
    for batch in (1, 4):
        inputs = _inputs("flux", model, batch, device)
        if batch == 4:  # request 0 of the batch is the batch-1 request
            inputs1 = _inputs("flux", model, 1, device)
            for k in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
                inputs[k][:1] = inputs1[k]
        out, ms, peak = _measure(lambda: _forward(model, inputs), device, repeats=REPEATS[SCALE]["flux"], warmup=1)
        _finite(out, f"batch {batch}")
        figures = {"forward_ms": ms, "images_per_second": batch / (STEPS * ms / 1e3)}
        if batch == 1:
            alone = out
        else:
            single = figures_by_batch[1]["images_per_second"]
            figures["throughput_vs_batch1_x"] = figures["images_per_second"] / single
            figures.update(_diff(out[:1], alone))
        figures["peak_bytes"] = peak
        figures_by_batch[batch] = figures
        _row("batch", f"{_describe('flux')}, batch {batch}", figures)
    return f"batch 4 / batch 1 throughput {figures_by_batch[4]['throughput_vs_batch1_x']:.2f}x"


def check_offload(device: str) -> str:
    """The added time of ``model.offload`` (``pipeline.offload``): a FLUX-sized forward with
    every weight on the GPU against one under diffusers' group offloading (block level, one
    block per group, prefetched on a CUDA stream: ``offload: group``), and an idle-expert swap
    (``offload: idle_expert``): a Wan-sized transformer moved to host memory and back, which a
    boundary-expert request pays twice (in at the boundary, back for the next request). Rows of
    ms and peak bytes; SKIP on CPU (host and device are the same memory)."""
    if not device.startswith("cuda"):
        raise Skip("host and device memory are the same on CPU: nothing to move")
    from diffusers.hooks import apply_group_offloading

    model = _model("flux", device)
    inputs = _inputs("flux", model, 1, device)
    resident, resident_ms, resident_peak = _measure(lambda: _forward(model, inputs), device,
                                                    repeats=REPEATS[SCALE]["flux"], warmup=1)
    apply_group_offloading(model, onload_device=torch.device(device), offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    out, grouped_ms, grouped_peak = _measure(lambda: _forward(model, inputs), device,
                                             repeats=REPEATS[SCALE]["flux"], warmup=1)
    _finite(out, "group offloading")
    _row("offload", f"{_describe('flux')}, group offloading", {
        "forward_ms": grouped_ms, "resident_forward_ms": resident_ms, "added_ms_per_forward": grouped_ms - resident_ms,
        "added_ms_per_image": STEPS * (grouped_ms - resident_ms), "peak_bytes": grouped_peak,
        "resident_peak_bytes": resident_peak, **_diff(out, resident)})
    model = inputs = out = resident = None
    _drop_models(device)  # the offloaded copy is not the one other checks expect
    expert = _model("wan", device)
    bytes_ = sum(p.numel() * p.element_size() for p in expert.parameters())
    _sync(device)
    t0 = time.perf_counter()
    expert.to("cpu")
    _sync(device)
    t1 = time.perf_counter()
    expert.to(device)
    _sync(device)
    t2 = time.perf_counter()
    out_ms, in_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
    _row("offload", f"{_describe('wan')}, idle-expert swap", {
        "expert_bytes": bytes_, "to_host_ms": out_ms, "to_gpu_ms": in_ms,
        "added_ms_per_request": 2 * (out_ms + in_ms)})
    return (f"group offloading +{STEPS * (grouped_ms - resident_ms):.0f} ms per {STEPS}-step image; idle-expert "
            f"swap +{2 * (out_ms + in_ms):.0f} ms per request")


ISSUE_THRESHOLD = 0.08  # residual_diff_threshold of the issue's dynamic policy
CALIBRATED: dict[str, float] = {}  # "threshold": the caching threshold found by the cache-dit check


def _dbcache(**knobs):
    """The DBCache override of these checks: Fn 8 (1 at ``--scale tiny``, which has 2 + 4
    blocks), Bn 0, 4 warm-up steps, plus ``knobs``; and its label for the table."""
    from pipeline.cache_dit_params import CacheDiTParams

    params = CacheDiTParams(Fn_compute_blocks=8 if SCALE == "full" else 1, Bn_compute_blocks=0, max_warmup_steps=4,
                            **knobs)
    label = f"DBCache F{params.Fn_compute_blocks}B0 w4, "
    if params.scm_preset:
        return params, label + f"SCM {params.scm_preset} {params.scm_policy}"
    return params, label + f"dynamic r{params.residual_diff_threshold:.3g}"


def _cached_run(executor, params, model: torch.nn.Module, inputs: dict, device: str):
    """Mount ``params`` on ``model`` and run :func:`_flux_denoise` once: ``(latents, ms,
    peak bytes, cached steps, residual diffs)``, the diffs being the relative L1 residual
    changes cache-dit measured at the steps it checked. Unmounts before returning."""
    import cache_dit

    from pipeline.state import CacheKey

    executor.mount(CacheKey(params, separate_cfg=False), STEPS, list(range(STEPS)))
    try:
        out, ms, peak = _measure(lambda: _flux_denoise(model, inputs), device)
        stats = cache_dit.summary(model, logging=False) or []
        diffs = [float(v) for s in stats for v in (s.residual_diffs or {}).values()]
        return out, ms, peak, executor.cached_steps(), diffs
    finally:
        executor.unmount()


def _caching_threshold(diffs: list[float]) -> float:
    """A threshold the dynamic policy caches at on these random weights (whose residuals
    change between steps far more than a trained model's): 1.5 x the median change."""
    return float(f"{1.5 * float(np.median(diffs)):.2g}") if diffs else 0.5


def check_cache_dit(device: str) -> str:
    """28 FLUX steps uncached, then with DBCache mounted: the issue's dynamic policy (r0.08),
    the dynamic policy at a threshold it caches at (:func:`_caching_threshold`) and the
    ``medium`` step-computation mask under the static policy. Rows of ms per image, speed-up,
    cached steps, difference from the uncached latents, peak bytes."""
    from pipeline.cache_dit_actions import CacheDiTExecutor

    model = _model("flux", device)
    inputs = _inputs("flux", model, 1, device)
    _forward(model, inputs)  # warm-up
    exact, exact_ms, peak = _measure(lambda: _flux_denoise(model, inputs), device)
    _finite(exact, "uncached")
    _row("cache-dit", f"{_describe('flux')}, {STEPS} steps, uncached", {"image_ms": exact_ms, "peak_bytes": peak})
    executor = CacheDiTExecutor(model)
    summary = []
    policies = [_dbcache(residual_diff_threshold=ISSUE_THRESHOLD), None,
                _dbcache(residual_diff_threshold=ISSUE_THRESHOLD, scm_preset="medium", scm_policy="static")]
    for policy in policies:
        if policy is None:  # needs the residual changes of the first run
            if "threshold" not in CALIBRATED:
                continue
            policy = _dbcache(residual_diff_threshold=CALIBRATED["threshold"])
        params, label = policy
        configuration = f"{_describe('flux')}, {STEPS} steps, {label}"
        try:
            out, ms, peak, cached, diffs = _cached_run(executor, params, model, inputs, device)
            _finite(out, label)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next policy
            traceback.print_exc()
            _row("cache-dit", configuration, {"error": f"{type(exc).__name__}: {exc}"}, "FAIL")
            continue
        figures = {"image_ms": ms, "speedup_x": exact_ms / ms, "cached_steps": cached}
        if params.residual_diff_threshold == ISSUE_THRESHOLD and not params.scm_preset:
            CALIBRATED["threshold"] = _caching_threshold(diffs)
            figures["median_residual_diff"] = float(np.median(diffs)) if diffs else None
        _row("cache-dit", configuration, {**figures, **_diff(out, exact), "peak_bytes": peak})
        summary.append(f"{label}: {cached}/{STEPS} cached, {exact_ms / ms:.2f}x")
    _failed_rows("cache-dit")
    return "; ".join(summary)


def check_compile(device: str) -> str:
    """torch.compile after a Cache-DiT mount (the dynamic policy at the threshold it caches at,
    so both the computed and the cached path compile): rows of eager ms per image, the first
    compiled run (s, graphs compiled) and the second (ms, speed-up, graphs compiled: must be 0,
    recompile-limit hits: must be 0). The compiled model is dropped afterwards
    (``module.compile`` cannot be undone)."""
    from compat.torch import dynamo_counts
    from pipeline.cache_dit_actions import CacheDiTExecutor
    from pipeline.runner import configure_compile
    from pipeline.state import CacheKey

    cuda = device.startswith("cuda")
    backend = "inductor" if cuda else "eager"  # CPU smoke: dynamo's tracing without a C++ build
    model = _model("flux", device)
    inputs = _inputs("flux", model, 1, device)
    executor = CacheDiTExecutor(model)
    try:
        _forward(model, inputs)  # warm-up
        if "threshold" not in CALIBRATED:  # run alone: measure the residual changes first
            *_, diffs = _cached_run(executor, _dbcache(residual_diff_threshold=ISSUE_THRESHOLD)[0], model, inputs,
                                    device)
            CALIBRATED["threshold"] = _caching_threshold(diffs)
        params, label = _dbcache(residual_diff_threshold=CALIBRATED["threshold"])
        base = f"{_describe('flux')}, {STEPS} steps, {label}"
        key = CacheKey(params, separate_cfg=False)
        executor.mount(key, STEPS, list(range(STEPS)))
        _flux_denoise(model, inputs)  # warm-up of the mounted path: the compiled run timed is a second run too
        executor.refresh(key, STEPS, list(range(STEPS)))
        eager, eager_ms, peak = _measure(lambda: _flux_denoise(model, inputs), device)
        eager_cached = executor.cached_steps()
        _row("compile", f"{base}, eager", {"image_ms": eager_ms, "cached_steps": eager_cached, "peak_bytes": peak})
        configure_compile(torch.device(device))
        before = dynamo_counts()
        model.compile(backend=backend)  # after the mount, as BatchRunner does
        executor.refresh(key, STEPS, list(range(STEPS)))
        t0 = time.perf_counter()
        _, _, first_peak = _measure(lambda: _flux_denoise(model, inputs), device)
        first_s = time.perf_counter() - t0
        middle = dynamo_counts()
        _row("compile", f"{base}, torch.compile({backend}) first run",
             {"run_s": first_s, "graphs_compiled": middle["compiled_graphs"] - before["compiled_graphs"],
              "cached_steps": executor.cached_steps(), "peak_bytes": first_peak})
        executor.refresh(key, STEPS, list(range(STEPS)))
        out, ms, peak = _measure(lambda: _flux_denoise(model, inputs), device)
        after = dynamo_counts()
        _finite(out, "compiled")
        recompiled = after["compiled_graphs"] - middle["compiled_graphs"]
        limit_hits = after["recompile_limit_hits"] - before["recompile_limit_hits"]
        figures = {"image_ms": ms, "speedup_vs_eager_x": eager_ms / ms, "graphs_compiled": recompiled,
                   "recompile_limit_hits": limit_hits, "cached_steps": executor.cached_steps(),
                   **_diff(out, eager), "peak_bytes": peak}
        ok = recompiled == 0 and limit_hits == 0 and middle["compiled_graphs"] > before["compiled_graphs"]
        _row("compile", f"{base}, torch.compile({backend}) second run", figures, "PASS" if ok else "FAIL")
    finally:
        executor.reset()
        _drop_models(device)  # compiled for good
    _failed_rows("compile")
    return (f"{middle['compiled_graphs'] - before['compiled_graphs']} graphs compiled, then {recompiled}; "
            f"{eager_ms / ms:.2f}x eager")


SERVE_TIMEOUT_S = 240  # start, one request, shutdown
SERVE_BODY = {"prompt": "a red circle on a blue background", "size": "64x64", "num_inference_steps": 4, "seed": 1,
              "response_format": "b64_json"}


def _serve_config(device: str, port: int) -> dict:
    """configs/tiny-cpu.yaml moved to ``device`` (bf16 and one GPU on CUDA) on HTTP ``port``."""
    import yaml

    config = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    args = config["applications"][0]["args"]
    cuda = device.startswith("cuda")
    args["model"].update(device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32")
    args["replica"]["ray_actor_options"] = {"num_cpus": 1, **({"num_gpus": 1} if cuda else {})}
    return config


def _stop(proc: subprocess.Popen) -> str:
    """Stop ``serve run`` as a user does (SIGINT: it shuts Serve and its local Ray cluster down),
    then whatever is left of the process group it leads. Returns how it ended."""
    ended = "exited by itself"
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
            ended = "stopped by SIGINT"
        except subprocess.TimeoutExpired:
            ended = "killed (SIGINT not honoured in 60 s)"
    for sig in (signal.SIGTERM, signal.SIGKILL):  # the group start_new_session made: only what we started
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(2)
    proc.wait(timeout=30)
    return ended


def check_serve(device: str) -> str:
    """One request end to end through ``serve run`` on ``device``: a row of seconds until
    ``/health`` answers, request ms, PNG bytes and the ``ditserve`` timings."""
    import base64
    import io

    import shutil

    import httpx
    import yaml
    from PIL import Image

    from parallel.groups import free_port

    _drop_models(device)  # the GPU to the replica
    port = free_port("127.0.0.1")
    tmp = Path(tempfile.mkdtemp(prefix="ditserve-gpu-check-"))
    (tmp / "serve.yaml").write_text(yaml.safe_dump(_serve_config(device, port)))
    log = tmp / "serve.log"
    serve_bin = Path(sys.executable).parent / "serve"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    deadline = t0 + SERVE_TIMEOUT_S
    with log.open("w") as out:  # --address local: a cluster of its own, never one already running here
        proc = subprocess.Popen([str(serve_bin), "run", str(tmp / "serve.yaml"), "--address", "local"], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-8:])

    figures = {}
    try:
        with httpx.Client(timeout=30) as client:
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"serve run exited with {proc.returncode}: {tail()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"/health not answering after {SERVE_TIMEOUT_S} s: {tail()}")
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(1)
            figures["startup_s"] = time.monotonic() - t0
            while True:  # the replica may still be starting behind a healthy ingress
                t1 = time.perf_counter()
                response = client.post(f"{url}/v1/images/generations", json=SERVE_BODY,
                                       timeout=max(deadline - time.monotonic(), 1))
                if response.status_code != 503 or time.monotonic() > deadline:
                    break
                time.sleep(1)
            figures["request_ms"] = (time.perf_counter() - t1) * 1e3
            assert response.status_code == 200, f"HTTP {response.status_code}: {response.text[:300]}"
            body = response.json()
            png = base64.b64decode(body["data"][0]["b64_json"])
            assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
            size = Image.open(io.BytesIO(png)).size
            assert size == (64, 64), f"image size {size}"
            meta = body["ditserve"]
            figures.update({"png_bytes": len(png), "denoise_ms": meta["timings_ms"]["denoise"],
                            "total_ms": meta["timings_ms"]["total"], "world_size": meta["world_size"]})
    except Exception as exc:
        raise AssertionError(f"{exc} (serve run's log: {log})") from exc
    finally:
        ended = _stop(proc)
    shutil.rmtree(tmp, ignore_errors=True)  # kept when the check fails
    figures["shutdown"] = ended
    _row("serve", f"serve run configs/tiny-cpu.yaml on {device}, 64x64, 4 steps", figures)
    return f"PNG through HTTP in {figures['request_ms']:.0f} ms; serve run {ended}"


CHECKS = {"kernels": check_kernels, "default-kernel": check_default_kernel, "ring-lse": check_ring_lse,
          "timings": check_timings, "memory": check_memory, "batch-invariance": check_batch_invariance,
          "ranks": check_ranks, "attention": check_attention, "batch": check_batch, "cache-dit": check_cache_dit,
          "compile": check_compile, "offload": check_offload, "serve": check_serve}


def _format(figures: dict) -> str:
    """Figures as table text: ``_ms`` / ``_s`` as times, ``_bytes`` in GiB, ``_x`` as ratios."""
    parts = []
    for key, value in figures.items():
        if value is None:
            continue
        if key in ("detail", "reason", "error"):
            parts.append(str(value))
        elif key.endswith("_bytes") and key != "png_bytes":
            parts.append(f"{key.removesuffix('_bytes')} {value / 2**30:.2f} GiB")
        elif key.endswith("_ms"):
            parts.append(f"{key.removesuffix('_ms')} {value:.1f} ms")
        elif key.endswith("_s"):
            parts.append(f"{key.removesuffix('_s')} {value:.1f} s")
        elif key.endswith("_x"):
            parts.append(f"{key.removesuffix('_x')} {value:.2f}x")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.3g}")
        else:
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def _table(rows: list[Row], widths: tuple[int, int] = (56, 90)) -> str:
    """The rows as one plain-text table (check, configuration, figures, status), configuration
    and figures wrapped at ``widths`` characters."""
    import textwrap

    def wrap(text: str, width: int) -> list[str]:
        return textwrap.wrap(text, width, break_long_words=False) or [""]

    cells = [("check", ["configuration"], ["figures"], "status")]
    cells += [(r.check, wrap(r.configuration, widths[0]), wrap(_format(r.figures), widths[1]), r.status)
              for r in rows]
    width = [max(len(c[0]) for c in cells), *(max(len(ln) for c in cells for ln in c[i]) for i in (1, 2))]
    lines = []
    for check, configuration, figures, status in cells:
        for i in range(max(len(configuration), len(figures))):
            first = i == 0
            lines.append(" | ".join([(check if first else "").ljust(width[0]),
                                     (configuration[i] if i < len(configuration) else "").ljust(width[1]),
                                     (figures[i] if i < len(figures) else "").ljust(width[2]),
                                     status if first else ""]).rstrip())
        if check == "check":
            lines.append("-+-".join("-" * w for w in width) + "-+-------")
    return "\n".join(lines)


def _environment(device: str) -> dict:
    """Versions and the device, for results.json."""
    import diffusers

    from parallel.kernels import installed_version

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "diffusers": diffusers.__version__, "host": platform.node(), "device": device, "scale": SCALE}
    env.update({name: installed_version(name) for name in ("cache-dit", "yunchang", "ray", "flash-attn",
                                                            "sageattention")})
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env.update({"gpu": torch.cuda.get_device_name(), "gpu_count": torch.cuda.device_count(),
                    "gpu_memory_bytes": props.total_memory, "compute_capability": f"{props.major}.{props.minor}"})
    return env


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def main() -> int:
    global SCALE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated: {', '.join(CHECKS)}")
    ap.add_argument("--scale", choices=("full", "tiny"), default=None,
                    help="sizes of the large checks (default: full on CUDA, tiny on CPU)")
    ap.add_argument("--results", type=Path, default=None,
                    help=f"write the figures here (default on CUDA: {RESULTS_PATH.relative_to(ROOT)}; on CPU: none)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    SCALE = args.scale or ("full" if cuda else "tiny")
    unknown = [n for n in args.only.split(",") if n not in CHECKS]
    if unknown:
        ap.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    if cuda:
        if not torch.cuda.is_available():
            ap.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device; "
                     "--device cpu makes a smoke run of the checks that run on CPU")
        print(f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}", flush=True)
    started, t_start = datetime.now(timezone.utc), time.perf_counter()
    checks = []
    for name in args.only.split(","):
        t0, first = time.perf_counter(), len(ROWS)
        try:
            status, detail = "PASS", CHECKS[name](args.device)
        except Skip as exc:
            status, detail = "SKIP", str(exc)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next check
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        seconds = time.perf_counter() - t0
        if len(ROWS) == first or status != "PASS":  # the checks with one figure, or what stopped a check
            ROWS.append(Row(name, "", {"detail": detail}, status))
        checks.append({"check": name, "status": status, "seconds": seconds, "detail": detail})
        print(f"{status} {name} ({seconds:.0f} s): {detail}", flush=True)
    total_s = time.perf_counter() - t_start
    print(f"\n{_table(ROWS)}\n\n{len(checks)} checks in {total_s:.0f} s", flush=True)
    path = args.results or (RESULTS_PATH if cuda else None)
    if path is not None:
        record = {"date": started.isoformat(timespec="seconds"), "seconds": total_s, **_environment(args.device),
                  "checks": checks, "rows": [asdict(r) for r in ROWS]}
        path.write_text(json.dumps(_json_safe(record), indent=1) + "\n")
        print(f"wrote {path}")
    return 1 if any(c["status"] == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
