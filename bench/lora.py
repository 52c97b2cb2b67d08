"""LoRA adapters, measured side by side in one run on the embedded tiny-flux.

1. Adapter loads (from disk) per 100 requests of a 4-adapter mixed workload on 2 replicas that
   each keep 2 adapters loaded (``max_loaded_loras: 2``), with adapter-affinity routing vs Ray
   Serve's default router (``batching.affinity: false``: FIFO over queues, power of two
   choices). Goal (issue 14): affinity <= 1/2 of the default's loads.
2. The time of an adapter switch, in one process: a load from disk (diffusers'
   ``load_lora_weights``), an activation from the LRU (``set_adapters``) and a hot-swap into
   the compiled slots, each vs one full batch (4 images, 64x64, 16 steps).

    python bench/lora.py [--requests 100] [--concurrency 8] [--routing-rounds 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from ray import serve  # noqa: E402

from bench import local_serve  # noqa: E402
from bench.batching import burst  # noqa: E402
from deployments.app import build_app  # noqa: E402
from deployments.config import EMBEDDED_LORA_DIR  # noqa: E402

# Four registered adapters: the two embedded ones, each also under a second name (a separate
# adapter to the LRU and the router: loaded, counted and evicted on its own).
ADAPTERS = {"magenta": "magenta", "outline": "outline", "magenta-b": "magenta", "outline-b": "outline"}


def app_args(affinity: bool) -> dict:
    return {"model": {"loras": {name: {"path": str(EMBEDDED_LORA_DIR / source)} for name, source in ADAPTERS.items()},
                      "max_loaded_loras": 2},
            "replica": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}, "torch_threads": 1},
            "batching": {"max_batch_size": 4, "max_wait_ms": 10, "affinity": affinity,
                         "max_affinity_wait_ms": 2000, "routing_stats_period_s": 0.5}}


def routing(ns) -> None:
    rng = random.Random(0)
    workload = [{"prompt": f"a shape {i}", "seed": i, "num_inference_steps": 4, "size": "64x64",
                 "lora": [{"name": rng.choice(list(ADAPTERS))}]} for i in range(ns.requests)]
    with local_serve(16) as port:
        base = f"http://127.0.0.1:{port}"
        client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=32))
        for name, affinity in (("affinity", True), ("default", False)):
            serve.run(build_app(app_args(affinity)), name=name, route_prefix=f"/{name}")
        counts = {name: [0, 0, 0.0] for name in ("affinity", "default")}  # loads, batches, seconds
        for name in counts:
            burst(client, f"{base}/{name}/v1/images/generations", [{"prompt": "warm", "size": "64x64",
                                                                    "num_inference_steps": 2}] * 2, 2)
        for r in range(ns.routing_rounds):  # alternated, each router first in every other round
            for name in (("affinity", "default") if r % 2 == 0 else ("default", "affinity")):
                seconds, metas = burst(client, f"{base}/{name}/v1/images/generations", workload, ns.concurrency)
                batches = {m["batch_id"]: m for m in metas}.values()  # each batch reports the loads it paid
                counts[name][0] += sum(m["acceleration"]["lora"]["loads"] for m in batches)
                counts[name][1] += len(batches)
                counts[name][2] += seconds
    print(f"{ns.requests} requests over {len(ADAPTERS)} adapters x {ns.routing_rounds} alternated rounds, "
          f"2 replicas x max_loaded_loras=2, {ns.concurrency} concurrent clients")
    per100 = {}
    for name, (n, batches, seconds) in counts.items():
        per100[name] = 100 * n / (ns.requests * ns.routing_rounds)
        print(f"  {name:8s} router: {per100[name]:5.1f} adapter loads per 100 requests ({n} in {batches} batches, "
              f"{seconds:.1f} s)")
    ratio = per100["affinity"] / per100["default"] if per100["default"] else float("nan")
    print(f"  affinity / default: {ratio:.2f}   goal <= 0.5: {'MET' if ratio <= 0.5 else 'MISSED'}")


def switch_times(ns) -> None:
    import torch

    from pipeline.contract.images import validate_image_request
    from pipeline.contract.limits import ServingLimits
    from pipeline.contract.lora import LoraSpec
    from pipeline.runner import BatchRunner
    from pipeline.sampling import resolve
    from pipeline.signature import BatchSignature
    from pipeline.wire import Batch

    torch.set_num_threads(2)
    paths = {name: str(EMBEDDED_LORA_DIR / source) for name, source in ADAPTERS.items()}
    eager = BatchRunner("tiny-flux", max_loaded_loras=4)
    compiled = BatchRunner("tiny-flux", loras=paths, torch_compile=True, compile_backend="eager", max_loras=1,
                           lora_max_rank=8)
    limits = ServingLimits("tiny-flux", eager.facts().spatial_factor, 64, 64, 16, 3.5)
    batch = tuple(resolve(validate_image_request({"prompt": f"a shape {i}", "seed": i}, limits), limits)
                  for i in range(4))
    # the compiled runner compiles its transformer in its first batch: swaps go into a compiled model
    compiled.denoise(Batch("warm", BatchSignature.of(batch[0]), batch[:1]))
    runs = {"full batch (4 x 64x64, 16 steps)": [], "load from disk": [], "activate from the LRU": [],
            "hot-swap into a compiled slot": []}
    for r in range(ns.rounds):
        t0 = time.perf_counter()
        eager.denoise(Batch("b", BatchSignature.of(batch[0]), batch))
        runs["full batch (4 x 64x64, 16 steps)"].append(time.perf_counter() - t0)
        name = f"round{r}"
        t0 = time.perf_counter()
        eager.lora.activate((LoraSpec(name, 1.0, paths["magenta"]),))  # a new name: loaded from disk
        runs["load from disk"].append(time.perf_counter() - t0)
        eager.lora.activate((LoraSpec("outline", 1.0, paths["outline"]),))
        t0 = time.perf_counter()
        eager.lora.activate((LoraSpec(name, 1.0, paths["magenta"]),))  # held: activated from the LRU
        runs["activate from the LRU"].append(time.perf_counter() - t0)
        compiled.lora.activate((LoraSpec("magenta", 1.0, paths["magenta"]),))
        t0 = time.perf_counter()
        compiled.lora.activate((LoraSpec("outline", 1.0, paths["outline"]),))
        runs["hot-swap into a compiled slot"].append(time.perf_counter() - t0)
        # back to the base model: the runner's own state says no adapter, so the next round's
        # "full batch" would otherwise run with this round's adapter still active (helper-34)
        eager.lora.activate(())
    full = statistics.median(runs["full batch (4 x 64x64, 16 steps)"])
    print(f"adapter switch vs one full batch, median of {ns.rounds} rounds, 2 threads")
    for what, times in runs.items():
        median = statistics.median(times)
        print(f"  {what:34s} {median * 1e3:8.1f} ms   {median / full:6.3f} of a batch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="adapter switch timing rounds")
    ap.add_argument("--routing-rounds", type=int, default=2, help="workload rounds per router, alternated")
    ns = ap.parse_args()
    routing(ns)
    switch_times(ns)


if __name__ == "__main__":
    main()
