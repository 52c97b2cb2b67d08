"""Multi-rank replicas on CPU: per-step time of 1 rank vs each 2-rank layout, side by side.

tiny-flux at a larger size (default 256x256: 1024 image tokens + 32 text tokens), fp32, a
guided request (true CFG: two forwards per step). Layouts (``--layouts``, all by default):
``ulysses`` and ``ring`` (sequence parallelism), ``cfg`` (``cfg_degree`` 2: the two forwards
on the two ranks), ``sharded`` (Ulysses 2 with ``shard_weights``: FSDP2 gathers each block's
weights per forward). The 1-rank run uses 2 torch threads, each of the 2 ranks 1 thread
(same cores); runs alternate 1-rank / 2-rank per round so machine noise hits both. Bytes sent
per step by rank 0 are counted from the tensors passed to ``torch.distributed.all_to_all_single``
/ ``all_gather_into_tensor`` / ``all_gather`` (yunchang's Ulysses all-to-all, the CFG
all-gather); ring attention's point-to-point K/V passing and FSDP2's weight all-gathers (issued
inside c10d) are not counted. Per-rank parameter bytes are rank 0's loaded weights, text
encoders and VAE included (with sharding: the transformer's local shards).

    python bench/sp.py [--size 256x256] [--steps 8] [--rounds 2] [--layouts ulysses,ring,cfg,sharded]
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
    body = {"prompt": "a red circle", "seed": 0, "size": size, "negative_prompt": "blurry", "true_cfg_scale": 2.0}
    p = resolve(validate_image_request(body, limits), limits)
    return Batch("bench", BatchSignature.of(p), (p,))


def _rank(rank, layout, port, size, steps, iters, conn):
    torch.set_num_threads(1)
    import torch.distributed as dist

    from parallel.config import ParallelConfig
    from parallel.groups import join
    from pipeline.runner import BatchRunner

    config = ParallelConfig.of(layout)
    runner = BatchRunner("tiny-flux")
    mesh = join(rank, config, "127.0.0.1", port, "cpu")
    runner.enable_parallel(config, mesh, rank)
    sent = [0]

    def counting(name, original):
        def counted(output, input, *args, **kwargs):  # measurement only: bytes this rank sends
            tensor = input if isinstance(input, torch.Tensor) else output
            share = 1.0
            if name == "all_to_all_single":  # the chunk for this rank stays here: (w - 1) / w leaves
                share = (config.world_size - 1) / config.world_size
            sent[0] += tensor.numel() * tensor.element_size() * share
            return original(output, input, *args, **kwargs)
        return counted

    for name in ("all_to_all_single", "all_gather_into_tensor", "all_gather"):
        setattr(dist, name, counting(name, getattr(dist, name)))
    batch = _batch(size, steps)
    runner.denoise(batch)  # warm-up
    times = []
    for _ in range(iters):
        sent[0] = 0
        dist.barrier()
        out = runner.denoise(batch)
        times.append(out.denoise_ms / steps)
    if rank == 0:
        conn.send((statistics.median(times), sent[0] / steps, runner.parameter_bytes()))
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


LAYOUTS = {"ulysses": {"ulysses_degree": 2}, "ring": {"ring_degree": 2}, "cfg": {"cfg_degree": 2},
           "sharded": {"ulysses_degree": 2, "shard_weights": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256x256")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ns = ap.parse_args()
    names = [n for n in ns.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"--layouts: unknown {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    torch.set_num_threads(2)
    from pipeline.runner import BatchRunner

    runner = BatchRunner("tiny-flux")
    ones, twos, last = [], {n: [] for n in names}, {}
    for _ in range(ns.rounds):
        for name in names:
            ones.append(one_rank(runner, ns.size, ns.steps, ns.iters))
            ms, sent, weights = two_ranks(LAYOUTS[name], ns.size, ns.steps, ns.iters)
            twos[name].append(ms)
            last[name] = (sent, weights)
    one = statistics.median(ones)
    print(f"tiny-flux {ns.size}, {ns.steps} steps, guided (true CFG), fp32, CPU: 2 ranks x 1 thread vs "
          f"1 rank x 2 threads, {ns.rounds} rounds")
    print(f"  {'layout':<10} {'ms/step':>9} {'speed-up':>9} {'MB sent/step':>13} {'weights/rank':>13}")
    print(f"  {'1 rank':<10} {one:9.1f} {1.0:8.2f}x {0.0:13.2f} {runner.parameter_bytes() / 1e6:11.2f}MB")
    for name in names:
        ms = statistics.median(twos[name])
        sent, weights = last[name]
        print(f"  {name:<10} {ms:9.1f} {one / ms:8.2f}x {sent / 1e6:13.2f} {weights / 1e6:11.2f}MB")


if __name__ == "__main__":
    main()
