"""Serving overhead: p50 latency of one request through HTTP vs the same batch in-process.

Both paths run the embedded tiny-flux with the same settings and torch thread count; the
two are measured alternately in one run so machine noise hits both alike. Target (issue 2):
HTTP p50 <= 1.10 x in-process p50 + 15 ms.

    python bench/overhead.py [--iters 30] [--steps 16] [--size 64x64] [--warmup]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402

from deployments.cli import start_app, stop_app  # noqa: E402
from parallel.groups import free_port  # noqa: E402
from pipeline.contract.limits import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--size", default="64x64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", action="store_true",
                    help="serve with acceleration.warmup (the replica runs one batch as it starts)")
    ns = ap.parse_args()

    torch.set_num_threads(ns.threads)
    args = {"replica": {"ray_actor_options": {"num_cpus": ns.threads}, "torch_threads": ns.threads},
            "acceleration": {"warmup": ns.warmup}}
    served = start_app(args, host="127.0.0.1", port=free_port("127.0.0.1"), num_cpus=4)
    url = served.url
    try:
        from pipeline.contract.images import validate_image_request
        from pipeline.contract.limits import ServingLimits
        from pipeline.runner import BatchRunner
        from pipeline.sampling import resolve
        from pipeline.signature import BatchSignature
        from pipeline.wire import Batch

        runner = BatchRunner("tiny-flux")
        width, height = parse_size(ns.size)
        body = {"prompt": "a red circle on a blue background", "seed": 0, "size": ns.size,
                "num_inference_steps": ns.steps}
        limits = ServingLimits("tiny-flux", runner.facts().spatial_factor, width, height, ns.steps, 3.5,
                               max_pixels=width * height)
        params = resolve(validate_image_request(body, limits), limits)
        batch = Batch("bench", BatchSignature.of(params), (params,))

        client = httpx.Client(timeout=120)
        endpoint = f"{url}/v1/images/generations"
        for _ in range(3):  # warm both paths
            client.post(endpoint, json=body).raise_for_status()
            runner.run(batch)
        http_ms, local_ms = [], []
        served_parts, local_parts = [], []  # per request: the replica's (and Ingress's) timings_ms
        for _ in range(ns.iters):
            t0 = time.perf_counter()
            response = client.post(endpoint, json=body)
            http_ms.append((time.perf_counter() - t0) * 1e3)
            response.raise_for_status()
            served_parts.append(response.json()["ditserve"]["timings_ms"])
            t0 = time.perf_counter()
            (out,) = runner.run(batch)
            local_ms.append((time.perf_counter() - t0) * 1e3)
            local_parts.append(out.timings_ms)
    finally:
        stop_app(served)
    http_p50, local_p50 = statistics.median(http_ms), statistics.median(local_ms)
    budget = 1.10 * local_p50 + 15
    print(f"tiny-flux {ns.size}, {ns.steps} steps, {ns.threads} torch threads, {ns.iters} iterations")
    print(f"in-process p50: {local_p50:8.1f} ms")
    print(f"HTTP p50:       {http_p50:8.1f} ms")
    print_breakdown(http_ms, served_parts, local_parts)
    print(f"ratio HTTP / in-process: {http_p50 / local_p50:.3f}   overhead: {http_p50 - local_p50:.1f} ms")
    print(f"target HTTP <= 1.10 x in-process + 15 ms = {budget:.1f} ms: {'MET' if http_p50 <= budget else 'MISSED'}")


def print_breakdown(http_ms: list[float], served: list[dict], local: list[dict]) -> None:
    """Where the HTTP request's time goes, p50 per part over the requests (ms): the replica's
    ``denoise`` and ``decode`` (decode + image encoding) against the same parts in-process, the
    Router's ``queue`` wait, the hops Ingress -> Router -> replica -> back (the Ingress's
    ``total`` less the parts inside it) and client -> proxy -> Ingress -> back (HTTP less the
    Ingress's ``total``). A p50 per part: the parts' p50s need not add up to the total's."""
    def p50(values) -> float:
        return statistics.median(values)

    rows = [
        ("denoise (replica / in-process)", p50(s["denoise"] for s in served), p50(s["denoise"] for s in local)),
        ("decode + encode (replica / in-process)", p50(s["decode"] for s in served), p50(s["decode"] for s in local)),
        ("Router queue", p50(s.get("queue", 0.0) for s in served), None),
        ("Ingress -> Router -> replica -> back", p50(s["total"] - s.get("queue", 0.0) - s["denoise"] - s["decode"]
                                                   for s in served), None),
        ("client -> proxy -> Ingress -> back", p50(h - s["total"] for h, s in zip(http_ms, served, strict=True)), None),
    ]
    print("breakdown, p50 per part (ms):")
    for name, value, reference in rows:
        print(f"  {name:<40} {value:8.1f}" + ("" if reference is None else f" / {reference:8.1f}"))


if __name__ == "__main__":
    main()
