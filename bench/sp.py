"""Sequence parallelism on CPU: per-step time of 1 vs 2 ranks and all-to-all bytes per step.

tiny-flux at a larger size (default 256x256: 1024 image tokens + 32 text tokens), fp32.
The 1-rank run uses 2 torch threads, each of the 2 ranks 1 thread (same cores); blocks
of runs alternate 1-rank / 2-rank so machine noise hits both. All-to-all bytes are counted
from the tensors yunchang hands torch.distributed.all_to_all_single on rank 0.

    python bench/sp.py [--size 256x256] [--steps 8] [--rounds 2] [--layout ulysses|ring]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _batch(size: str, steps: int):
    from pipeline.contract.images import validate_image_request
    from pipeline.contract.limits import ServingLimits, parse_size
    from pipeline.sampling import resolve
    from pipeline.signature import BatchSignature
    from pipeline.wire import Batch

    w, h = parse_size(size)
    limits = ServingLimits("tiny-flux", 8, w, h, steps, 3.5, max_pixels=w * h)
    p = resolve(validate_image_request({"prompt": "a red circle", "seed": 0, "size": size}, limits), limits)
    return Batch("bench", BatchSignature.of(p), (p,))


def _rank(rank, layout, port, size, steps, iters, conn):
    torch.set_num_threads(1)
    import torch.distributed as dist

    from parallel.config import ParallelConfig
    from parallel.groups import join
    from pipeline.runner import BatchRunner

    config = ParallelConfig(**layout)
    runner = BatchRunner("tiny-flux")
    mesh = join(rank, config, "127.0.0.1", port, "cpu")
    runner.enable_sequence_parallel(config, mesh, rank)
    sent = [0]
    original = dist.all_to_all_single

    def counted(output, input, *args, **kwargs):  # measurement only: bytes this rank sends
        sent[0] += input.numel() * input.element_size()
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = counted
    batch = _batch(size, steps)
    runner.denoise(batch)  # warm-up
    times = []
    for _ in range(iters):
        sent[0] = 0
        dist.barrier()
        out = runner.denoise(batch)
        times.append(out.denoise_ms / steps)
    if rank == 0:
        conn.send((statistics.median(times), sent[0] / steps))
    dist.barrier()


def two_ranks(layout, size, steps, iters):
    from parallel.groups import free_port

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, layout, port, size, steps, iters, child)) for r in range(2)]
    for p in procs:
        p.start()
    result = parent.recv()
    for p in procs:
        p.join()
    return result


def one_rank(runner, size, steps, iters):
    batch = _batch(size, steps)
    runner.denoise(batch)
    return statistics.median(runner.denoise(batch).denoise_ms / steps for _ in range(iters))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256x256")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layout", choices=["ulysses", "ring"], default="ulysses")
    ns = ap.parse_args()
    layout = {"ulysses_degree": 2, "ring_degree": 1} if ns.layout == "ulysses" else {"ulysses_degree": 1,
                                                                                       "ring_degree": 2}
    torch.set_num_threads(2)
    from pipeline.runner import BatchRunner

    runner = BatchRunner("tiny-flux")
    ones, twos, sent = [], [], 0.0
    for _ in range(ns.rounds):
        ones.append(one_rank(runner, ns.size, ns.steps, ns.iters))
        ms, sent = two_ranks(layout, ns.size, ns.steps, ns.iters)
        twos.append(ms)
    one, two = statistics.median(ones), statistics.median(twos)
    print(f"tiny-flux {ns.size}, {ns.steps} steps, fp32, CPU, {ns.layout} 2 ranks x 1 thread vs 1 rank x 2 threads")
    print(f"  per-step time, 1 rank:  {one:8.1f} ms")
    print(f"  per-step time, 2 ranks: {two:8.1f} ms   speed-up {one / two:.2f}x")
    print(f"  all-to-all bytes sent per step by rank 0: {sent / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
