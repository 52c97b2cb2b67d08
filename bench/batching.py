"""Batching and affinity, measured side by side in one run on the embedded tiny-flux.

1. Throughput (images/s) of 16 concurrent equal-signature requests with
   ``max_batch_size`` 1 vs 8 (two apps, one replica each, rounds alternated).
   Target (issue 3): batching >= 2.5x.
2. Acceleration-state changes per 100 requests of a 4-signature mixed workload on
   2 replicas, with affinity routing vs Ray Serve's default router (FIFO over queues,
   power of two choices). Target: affinity <= 1/2 of the default's changes, with a p99
   latency at most 10 % above the default router's (both printed).

    python bench/batching.py [--rounds 3] [--requests 100]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from deployments.app import build_app  # noqa: E402
from parallel.groups import free_port  # noqa: E402


def app_args(max_batch_size: int, replicas: int, threads: int, affinity: bool = True,
             switch_cost_ms: float = 250) -> dict:
    return {"replica": {"num_replicas": replicas, "ray_actor_options": {"num_cpus": threads},
                        "torch_threads": threads},
            "batching": {"max_batch_size": max_batch_size, "max_wait_ms": 10, "affinity": affinity,
                         "affinity_switch_cost_ms": switch_cost_ms, "max_affinity_wait_ms": 2000,
                         "routing_stats_period_s": 0.5},
            "limits": {"max_n": min(4, max_batch_size)}}  # a request's n images run in one batch


def burst(client: httpx.Client, url: str, bodies: list[dict], concurrency: int,
          latencies: list[float] | None = None) -> tuple[float, list[dict]]:
    """Post ``bodies`` with ``concurrency`` clients: (seconds, metadata of each answer); each
    request's latency (ms) is appended to ``latencies``."""
    def one(body: dict) -> httpx.Response:
        started = time.perf_counter()
        r = client.post(url, json=body)
        if latencies is not None:
            latencies.append((time.perf_counter() - started) * 1e3)
        return r

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        responses = list(pool.map(one, bodies))
    elapsed = time.perf_counter() - t0
    for r in responses:
        r.raise_for_status()
    return elapsed, [r.json()["ditserve"] for r in responses]


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--mixed-rounds", type=int, default=3)
    ap.add_argument("--switch-costs", type=float, nargs="+", default=[250, 100],
                    help="affinity_switch_cost_ms of the affinity routers compared with the default one "
                         "(the first is the configuration default; the others show the trade-off)")
    ns = ap.parse_args()

    port = free_port("127.0.0.1")
    ray.init(num_cpus=16, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=32))
    try:
        # 1. throughput, batch size 1 vs 8
        serve.run(build_app(app_args(1, 1, 2)), name="bs1", route_prefix="/bs1")
        serve.run(build_app(app_args(8, 1, 2)), name="bs8", route_prefix="/bs8")
        bodies = [{"prompt": f"a shape number {i}", "seed": i, "num_inference_steps": ns.steps} for i in range(16)]
        rates = {"bs1": [], "bs8": []}
        sizes = {"bs1": [], "bs8": []}
        for name in rates:  # warm-up
            burst(client, f"{base}/{name}/v1/images/generations", bodies[:4], 4)
        for _ in range(ns.rounds):
            for name in rates:
                elapsed, metas = burst(client, f"{base}/{name}/v1/images/generations", bodies, 16)
                rates[name].append(len(bodies) / elapsed)
                sizes[name] += [m["batch_size"] for m in {m["batch_id"]: m for m in metas}.values()]
        serve.delete("bs1")
        serve.delete("bs8")
        r1, r8 = statistics.median(rates["bs1"]), statistics.median(rates["bs8"])
        print(f"16 concurrent requests, tiny-flux 64x64, {ns.steps} steps, 1 replica x 2 threads, "
              f"{ns.rounds} alternated rounds")
        print(f"  max_batch_size=1: {r1:6.2f} images/s")
        print(f"  max_batch_size=8: {r8:6.2f} images/s   (mean batch size {statistics.mean(sizes['bs8']):.1f})")
        print(f"  batching speed-up: {r8 / r1:.2f}x   target >= 2.5x: {'MET' if r8 / r1 >= 2.5 else 'MISSED'}")

        # 2. state changes, affinity (at several affinity_switch_cost_ms) vs default router, rounds alternated
        apps = {"default": app_args(4, 2, 1, affinity=False)}
        for cost_ms in ns.switch_costs:
            apps[f"affinity, switch {cost_ms:g} ms"] = app_args(4, 2, 1, affinity=True, switch_cost_ms=cost_ms)
        routes = {}
        for i, (name, args) in enumerate(apps.items()):
            routes[name] = f"{base}/mixed{i}/v1/images/generations"
            serve.run(build_app(args), name=f"mixed{i}", route_prefix=f"/mixed{i}")
        rng = random.Random(0)
        workload = [{"prompt": f"p{i}", "seed": i, "num_inference_steps": rng.choice([2, 3, 4, 5])}
                    for i in range(ns.requests)]
        changes = {name: [0, 0] for name in apps}  # state changes, batches
        latencies = {name: [] for name in apps}
        for name in apps:
            burst(client, routes[name], workload[:8], 8)  # warm-up
        for _ in range(ns.mixed_rounds):
            for name in apps:
                _, metas = burst(client, routes[name], workload, 8, latencies[name])
                batches = {m["batch_id"]: m for m in metas}.values()
                changes[name][0] += sum(m["state_change"] for m in batches)
                changes[name][1] += len(batches)
        total = ns.requests * ns.mixed_rounds
        per100 = {name: 100 * c / total for name, (c, _) in changes.items()}
        print(f"{ns.requests} requests over 4 signatures x {ns.mixed_rounds} alternated rounds, 2 replicas, "
              f"8 concurrent clients, max_batch_size 4")
        for name in apps:
            c, b = changes[name]
            print(f"  {name:26s}: {per100[name]:5.1f} state changes per 100 requests ({c} in {b} batches), "
                  f"latency p99 {p99(latencies[name]):.0f} ms")
        for name in list(apps)[1:]:
            ratio = per100[name] / per100["default"] if per100["default"] else float("nan")
            slower = p99(latencies[name]) / p99(latencies["default"])
            print(f"  {name:26s}: changes / default {ratio:.2f} (target <= 0.5: "
                  f"{'MET' if ratio <= 0.5 else 'MISSED'}); p99 / default {slower:.2f} (target <= 1.10: "
                  f"{'MET' if slower <= 1.10 else 'MISSED'})")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
