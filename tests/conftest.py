"""Shared fixtures: one local Ray cluster per test session and a helper to (re)deploy the app.

Real components only: ``ray.init`` + ``serve.run`` (never local testing mode), real HTTP on
a free loopback port.
"""

from __future__ import annotations

import os

os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # before cache_dit is imported anywhere

import pytest

from parallel.groups import free_port


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray import serve

    from deployments.proxy import install

    install()  # Serve's proxy answers its own errors in OpenAI's envelope (deployments/proxy.py)
    ray.init(num_cpus=8, log_to_driver=False, include_dashboard=False)
    port = free_port("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield {"url": f"http://127.0.0.1:{port}", "gcs_address": ray.get_runtime_context().gcs_address}
    serve.shutdown()
    ray.shutdown()


def _replicas(args: dict) -> int:
    """DiTReplica replicas the app starts with (``num_replicas``, or autoscaling's initial count)."""
    from pydantic import ValidationError

    from deployments.config import AppConfig

    try:
        return AppConfig.model_validate(args).replica.initial_replicas
    except ValidationError:  # a test of a bad config: serve.run is to refuse it
        return 1


@pytest.fixture(scope="session")
def deploy(ray_cluster):
    """``deploy(args) -> base URL``: run ``build_app(args)`` as the ``ditserve`` app, replacing
    whatever ran before; repeated calls with equal args reuse the running app."""
    from ray import serve

    from deployments.app import build_app

    current = {}

    def _deploy(args: dict | None = None, fresh: bool = False) -> str:
        args = args or {}
        running = serve.status().applications.get("ditserve")
        if fresh or current.get("args") != args or running is None or running.status != "RUNNING":
            if running is not None and _replicas(args) != 1:
                # Serve replaces a deployment's replicas one after the other (a rolling update,
                # ~8 s each here); after a delete they all start at once: measured 19 -> 15 s for
                # two replicas after two, 21 -> 18 s after one (and 14 -> 15 s for one: not done)
                serve.delete("ditserve")
            serve.run(build_app(args), name="ditserve", route_prefix="/")
            current["args"] = args
        return ray_cluster["url"]

    return _deploy
