"""Overload: offer 10x what the app can serve and check that the excess is refused fast.

1. Capacity: the app's throughput (requests/s) with full batches, measured with a closed loop.
2. Burst: an open-loop client sends requests at ``--factor`` x capacity for ``--seconds``; the
   Router's queue fills to ``max_queued_requests`` and later requests must be refused at once
   (429, or 503, each with the envelope's code ``overloaded``) while every accepted one is
   answered 200 (any other answer, a 503 ``unavailable`` too, is an accepted request failed).
3. Memory: resident set size of every Serve process before, at the peak, and after the burst.

Printed: the offered rate, answers by status, refusal latency p50 / p99, accepted answered,
peak and after RSS per process. Goals: refusal p99 < 50 ms, every accepted request 200, RSS
back within +-10 % of its baseline after the burst.

    .venv/bin/python bench/overload.py [--config configs/tiny-cpu.yaml] [--factor 10] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.footprint import rss_mib, serve_processes  # noqa: E402
from deployments.cli import load_serve_config  # noqa: E402
from bench import local_serve  # noqa: E402

BODY = {"prompt": "a red circle on a blue background", "num_inference_steps": 4, "size": "64x64"}
P99_GOAL_MS = 50.0


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def capacity(url: str, clients: int, seconds: float) -> float:
    """Requests/s the app completes with ``clients`` closed-loop clients (full batches)."""
    done, stop = [], threading.Event()

    def loop(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not stop.is_set():
                n += 1
                if http.post(url, json={**BODY, "seed": i * 10_000 + n}).status_code == 200:
                    done.append(time.monotonic())

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # warm
    start = time.monotonic()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(start <= t <= start + seconds for t in done) / seconds


REFUSAL_CODE = "overloaded"  # the envelope's code of a refusal (the proxy's, the Ingress's, the Router's)


async def burst(url: str, rate: float, seconds: float) -> list[tuple[object, float, bool, str | None]]:
    """Open loop: one request every 1/rate s for ``seconds``; (status, latency s, envelope?,
    the envelope's error code or None) each.

    aiohttp (C-accelerated, already a Ray Serve dependency) so the load generator keeps its
    schedule on a 2-core machine; the send lag it reports shows whether it did.
    """
    import aiohttp

    results, lags = [], []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def one(i: int, due: float) -> None:
            started = time.monotonic()
            lags.append(started - due)
            try:
                async with http.post(url, json={**BODY, "seed": i}) as r:
                    body = await r.read()
                    code = None
                    if r.status != 200:
                        try:
                            code = json.loads(body)["error"]["code"]
                        except (ValueError, KeyError, TypeError):
                            pass
                    envelope = r.status == 200 or b'"error"' in body[:64]
                    results.append((r.status, time.monotonic() - started, envelope, code))
            except Exception as exc:  # noqa: BLE001 - no answer at all
                results.append((type(exc).__name__, time.monotonic() - started, False, None))

        tasks, start, n = [], time.monotonic(), int(rate * seconds)
        for i in range(n):
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(i, due)))
        await asyncio.gather(*tasks)
    print(f"load generator send lag: p50 {statistics.median(lags) * 1e3:.1f} ms, max {max(lags) * 1e3:.1f} ms")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ns = ap.parse_args()

    from ray import serve

    from deployments.app import build_app

    config = load_serve_config(ns.config)
    with local_serve(8) as port:
        serve.run(build_app(config["args"]), name="ditserve", route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/images/generations"
        batching = config["args"].get("batching", {})
        max_batch = batching.get("max_batch_size", 8)
        served = capacity(url, clients=2 * max_batch, seconds=6.0)
        time.sleep(1.0)
        processes = serve_processes()  # this cluster's, found once: the replicas stay up
        baseline = {title: rss_mib(pid) for title, pid in processes.items()}
        peak = dict(baseline)
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                for title, pid in processes.items():
                    try:
                        peak[title] = max(peak.get(title, 0.0), rss_mib(pid))
                    except OSError:
                        pass
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rate = ns.factor * served
        results = asyncio.run(burst(url, rate, ns.seconds))
        sampling.set()
        sampler.join()
        time.sleep(12.0)  # the routing processes give memory back once idle (deployments/memory.py)
        after = {title: rss_mib(pid) for title, pid in processes.items()}

    statuses = Counter(f"{s} {c}" if c else str(s) for s, _, _, c in results)
    refusal = lambda s, c: s in (429, 503) and c == REFUSAL_CODE  # noqa: E731
    refused = [lat * 1e3 for s, lat, _, c in results if refusal(s, c)]
    accepted_ok = all(s == 200 or refusal(s, c) for s, _, _, c in results)
    p50, p99 = percentile(refused, 0.5), percentile(refused, 0.99)
    ok_latency = [lat for s, lat, _, _ in results if s == 200]
    print(f"{ns.config}: capacity {served:.1f} requests/s (closed loop, {2 * max_batch} clients, full batches of "
          f"{max_batch}); burst {ns.factor:g}x = {rate:.1f} requests/s for {ns.seconds:g} s, open loop")
    print(f"answers: {dict(sorted(statuses.items()))}; not an envelope: {sum(not e for _, _, e, _ in results)}")
    for status in (429, 503):
        part = [lat * 1e3 for s, lat, _, c in results if s == status and c == REFUSAL_CODE]
        if part:
            print(f"  {status}: n={len(part)} p50 {percentile(part, 0.5):.1f} ms p99 {percentile(part, 0.99):.1f} ms")
    print(f"refusals (429/503 {REFUSAL_CODE}): p50 {p50:.1f} ms, p99 {p99:.1f} ms   accepted (200): p50 "
          f"{statistics.median(ok_latency) if ok_latency else float('nan'):.2f} s")
    print(f"{'process':44s} {'base MiB':>9s} {'peak MiB':>9s} {'after MiB':>9s}")
    mem_ok = True
    for title in sorted(baseline):
        back = abs(after.get(title, 0.0) - baseline[title]) <= 0.10 * baseline[title]
        mem_ok &= back
        print(f"{title:44s} {baseline[title]:9.1f} {peak.get(title, 0.0):9.1f} {after.get(title, 0.0):9.1f}"
              f"{'' if back else '  (not back within 10 %)'}")
    print(f"goal: refusal p99 < {P99_GOAL_MS:.0f} ms: {'MET' if refused and p99 < P99_GOAL_MS else 'MISSED'}; "
          f"every accepted request 200: {'MET' if accepted_ok else 'MISSED'}; "
          f"memory back to baseline +-10 %: {'MET' if mem_ok else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
