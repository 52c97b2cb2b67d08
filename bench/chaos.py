"""Kill a part of a running ditserve app mid-batch and watch every request get its answer.

Per fault: a local Ray cluster serves a CPU config; a few HTTP clients send requests without
pause; after the warm-up one actor is killed (``ray.kill``) while a batch runs: the replica
(``DiTReplica``), rank 1 of a sequence-parallel replica, the ``Router`` or the ``Ingress``.
Printed per fault: requests answered / sent, answers by status, answers that were not OpenAI's
error envelope, the slowest answer, and the seconds from the kill to the first success.
Goals: every request answered (none hung past its client timeout), every error an envelope,
recovery <= 15 s.

    .venv/bin/python bench/chaos.py [--faults replica,rank,router,ingress] [--clients 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.cli import load_serve_config  # noqa: E402
from bench import local_serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"replica": "configs/tiny-cpu.yaml", "rank": "configs/tiny-cpu-sp2.yaml",
           "router": "configs/tiny-cpu.yaml", "ingress": "configs/tiny-cpu.yaml"}
BODY = {"prompt": "a red circle on a blue background", "num_inference_steps": 12, "size": "64x64"}
CLIENT_TIMEOUT_S = 120.0
RECOVERY_GOAL_S = 15.0


def _target(fault: str):
    """The actor to kill for ``fault`` (a Serve replica by deployment, or rank 1)."""
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if fault == "rank" and name.endswith("-rank1"):
            return ray.get_actor(name, namespace=actor["namespace"])
        deployment = {"replica": "DiTReplica", "router": "Router", "ingress": "Ingress"}.get(fault)
        if deployment and name.startswith("SERVE_REPLICA::") and f"#{deployment}#" in name:
            return ray.get_actor(name, namespace=actor["namespace"])
    raise RuntimeError(f"no actor to kill for fault {fault!r}")


def _is_envelope(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except Exception:  # noqa: BLE001 - not JSON, or no "error" key
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def run_fault(fault: str, clients: int, warmup_s: float, after_s: float) -> dict:
    import ray
    from ray import serve

    from deployments.app import build_app

    config = load_serve_config(ROOT / CONFIGS[fault])
    results, stop, killed_at = [], threading.Event(), []
    with local_serve(8) as port:
        serve.run(build_app(config["args"]), name="ditserve", route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/images/generations"

        def client(i: int) -> None:
            with httpx.Client(timeout=CLIENT_TIMEOUT_S) as http:
                n = 0
                while not stop.is_set():
                    n += 1
                    started = time.monotonic()
                    try:
                        r = http.post(url, json={**BODY, "seed": 1000 * i + n})
                        results.append((started, time.monotonic(), r.status_code, r.status_code == 200 or
                                        _is_envelope(r)))
                    except httpx.HTTPError as exc:  # no answer at all (timeout, connection reset)
                        results.append((started, time.monotonic(), type(exc).__name__, False))
                    if results[-1][2] != 200:
                        time.sleep(0.2)  # a client backs off a little after an error

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        time.sleep(warmup_s)
        target = _target(fault)
        killed_at.append(time.monotonic())
        ray.kill(target, no_restart=False)
        time.sleep(after_s)
        stop.set()
        for t in threads:
            t.join(timeout=CLIENT_TIMEOUT_S + 10)
        hung = sum(t.is_alive() for t in threads)
    kill = killed_at[0]
    after = [r for r in results if r[0] >= kill - 30]
    first_ok = min((r[1] for r in results if r[2] == 200 and r[0] >= kill), default=None)
    return {"sent": len(results) + hung, "answered": len(results), "hung": hung,
            "statuses": Counter(str(r[2]) for r in after), "non_envelope": sum(not r[3] for r in results),
            "slowest_s": max((r[1] - r[0] for r in results), default=0.0),
            "recovery_s": None if first_ok is None else first_ok - kill,
            "p50_s": statistics.median(r[1] - r[0] for r in results if r[2] == 200) if results else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", default="replica,rank,router,ingress")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--after-s", type=float, default=30.0, help="seconds of load after the kill")
    ns = ap.parse_args()
    rows = []
    for fault in ns.faults.split(","):
        print(f"-- killing the {fault} of {CONFIGS[fault]} under {ns.clients} clients ...", flush=True)
        rows.append((fault, run_fault(fault, ns.clients, ns.warmup_s, ns.after_s)))
    print(f"\n{'fault':8s} {'answered':>9s} {'hung':>5s} {'non-envelope':>12s} {'slowest s':>10s} "
          f"{'recovery s':>10s}  answers by status (from 30 s before the kill)")
    met = True
    for fault, r in rows:
        ok = (r["hung"] == 0 and r["non_envelope"] == 0 and r["recovery_s"] is not None
              and r["recovery_s"] <= RECOVERY_GOAL_S)
        met &= ok
        recovery = "never" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}"
        print(f"{fault:8s} {r['answered']:>4d}/{r['sent']:<4d} {r['hung']:>5d} {r['non_envelope']:>12d} "
              f"{r['slowest_s']:>10.1f} {recovery:>10s}  {dict(sorted(r['statuses'].items()))}  "
              f"{'MET' if ok else 'MISSED'}")
    print(f"goal: all answered, none hung, every error an envelope, recovery <= {RECOVERY_GOAL_S:.0f} s: "
          f"{'MET' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
