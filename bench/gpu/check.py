"""The first GPU run: every GPU-readiness check that a CPU cannot show, in one command.

    .venv/bin/python bench/gpu/check.py [--device cuda] [--only kernels,ring-lse,...]

Each check prints one line, ``PASS``/``FAIL``/``SKIP`` with its figures, and the script exits
1 when any check fails. Items refer to the GPU-readiness issue (19); the CPU suite proves
the rest (tests/test_kernels.py, tests/test_faults.py, tests/test_parallel.py).

- ``kernels`` (4): every attention kernel the replica accepts runs a request; every one it
  refuses names why (installed versions printed).
- ``default-kernel`` (5): a replica refuses to start with ``attention_backend: fa`` in float32.
- ``ring-lse`` (6): ring merges (yunchang's ``update_out_and_lse``) of two key blocks with
  the LSE of torch's CUDA memory-efficient kernel (sliced and upcast) and of flash-attn equal
  attention over all keys; the raw padded LSE fails to merge.
- ``timings`` (9): a batch's ``denoise`` time against the wall time around it (with the
  step-boundary ``torch.cuda.synchronize`` they agree; without it ``denoise`` undercounts).
- ``memory`` (11): GPU bytes of a rank that loads the transformers alone against rank 0,
  host memory while loading straight to the GPU, and the decode peak with VAE slicing.
- ``batch-invariance`` (12): bf16 pixels of a request alone against the same request in a
  batch of 4: the bound the README states.
- ``ranks`` (6, 8, 11; 2+ GPUs): two rank actors get different GPUs, and a 2-rank Ulysses and
  ring replica equal one rank.

``--device cpu`` runs what applies on CPU (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

RESULTS: list[tuple[str, str, str]] = []


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
    runner = _runner(device)
    size = "1024x1024" if device.startswith("cuda") else "128x128"  # CPU: a smoke run
    batch = _params(runner, [{**BODY, "size": size, "num_inference_steps": 8, "seed": s} for s in (1, 2)])
    runner.denoise(batch)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    out = runner.denoise(batch)
    _sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    ratio = out.denoise_ms / (wall_ms - out.decode_ms)  # the rest: encoding the prompts
    detail = (f"denoise {out.denoise_ms:.1f} ms of {wall_ms - out.decode_ms:.1f} ms wall before decode "
              f"(ratio {ratio:.2f}), decode {out.decode_ms:.1f} ms")
    assert 0.5 <= ratio <= 1.0, detail
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


def check_batch_invariance(device: str) -> str:
    runner = _runner(device)
    others = [{**BODY, "prompt": p, "seed": s} for s, p in ((11, "a green star"), (12, "two squares"),
                                                            (13, "a yellow triangle at night"))]
    alone = _pixels(runner.run(_params(runner, [BODY]))[0].images[0])
    batched = _pixels(runner.run(_params(runner, [BODY, *others]))[0].images[0])
    diff = np.abs(alone - batched)
    detail = f"bf16 alone vs in a batch of 4: max {diff.max()} levels, mean {diff.mean():.3f} (0-255)"
    assert diff.max() <= 32, detail
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


CHECKS = {"kernels": check_kernels, "default-kernel": check_default_kernel, "ring-lse": check_ring_lse,
          "timings": check_timings, "memory": check_memory, "batch-invariance": check_batch_invariance,
          "ranks": check_ranks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated: {', '.join(CHECKS)}")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        assert torch.cuda.is_available(), "no CUDA device (use --device cpu for a smoke run)"
        print(f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}", flush=True)
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            status, detail = "PASS", CHECKS[name](args.device)
        except Skip as exc:
            status, detail = "SKIP", str(exc)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next check
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        RESULTS.append((name, status, detail))
        print(f"{status} {name} ({time.perf_counter() - t0:.0f} s): {detail}", flush=True)
    return 1 if any(status == "FAIL" for _, status, _ in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
