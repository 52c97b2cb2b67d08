"""Resident memory of every Serve process of a running ditserve app, and whether each loaded torch.

Starts a local Ray cluster, deploys a Serve config file (default ``configs/tiny-cpu.yaml``), sends
one image request so every process has done its work once, then reads each process's resident set
size (RSS, MiB) and its memory map (``/proc/PID/maps``: is ``libtorch`` mapped?), each of this
cluster's Serve actors by the process title Ray gives it (``ray::ServeReplica:APP:DEPLOYMENT``).
Linux only.

    .venv/bin/python bench/footprint.py [--config configs/tiny-cpu.yaml]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.cli import load_serve_config  # noqa: E402
from bench import local_serve  # noqa: E402

SERVE_NAMESPACE = "serve"  # where Ray Serve names its controller, proxies and replicas


def serve_processes() -> dict[str, int]:
    """``{process title: pid}`` of this Ray cluster's Serve actors (controller, proxies,
    replicas): the named actors of Serve's namespace, each asked its pid, titled as Ray titles
    its process (``ServeReplica:APP:DEPLOYMENT``, from ``/proc/PID/cmdline``). Other clusters on
    the machine run processes of the same titles: a scan of ``/proc`` alone could read theirs."""
    import ray

    found = {}
    for named in ray.util.list_named_actors(all_namespaces=True):
        if named["namespace"] != SERVE_NAMESPACE:
            continue
        try:
            actor = ray.get_actor(named["name"], namespace=named["namespace"])
            pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (ray.exceptions.RayError, OSError, ValueError):  # gone meanwhile, or on another node
            continue
        # the title, without the method a worker runs now (ray::ServeController.listen_for_change)
        found[cmdline.split(" ")[0].removeprefix("ray::").split(".")[0]] = pid
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def loads_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    ns = parser.parse_args()

    from ray import serve

    from deployments.app import build_app

    config = load_serve_config(ns.config)
    with local_serve(4) as port:
        serve.run(build_app(config["args"]), name="ditserve", route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/images/generations"
        r = httpx.post(url, json={"prompt": "a red circle", "seed": 1, "num_inference_steps": 2}, timeout=300)
        r.raise_for_status()
        time.sleep(1.0)
        print(f"{'process':44s} {'RSS MiB':>8s}  torch")
        light = {}  # the Ingress's and Router's processes: torch loaded?
        for title, pid in sorted(serve_processes().items()):
            torch = loads_torch(pid)
            print(f"{title:44s} {rss_mib(pid):8.1f}  {'yes' if torch else 'no'}")
            if title.endswith((":Ingress", ":Router")):
                light[title] = torch
    met = len(light) == 2 and not any(light.values())
    print(f"goal: the Ingress and the Router load no torch (README, Footprint): {'MET' if met else 'MISSED'}"
          + ("" if len(light) == 2 else f" (found {sorted(light)})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
