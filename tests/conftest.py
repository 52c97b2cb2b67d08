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


# Serve's 2 s graceful_shutdown_wait_loop_s is the floor of every stop of an idle replica: each
# redeploy and delete of the suite's ~60 waited it out (measured: delete 3.0 -> 1.0 s, redeploy
# 8.2-9.3 -> 7.1-8.2 s at 0.2 s). Tests that set their own keep it.
TEST_WAIT_LOOP_S = 0.5


def _with_short_wait_loop(args: dict) -> dict:
    """``args`` with ``replica.graceful_shutdown_wait_loop_s`` at ``TEST_WAIT_LOOP_S`` unless given."""
    replica = args.get("replica", {})
    if not isinstance(replica, dict) or "graceful_shutdown_wait_loop_s" in replica:
        return args  # a test of a bad config, or one that chose its own
    return {**args, "replica": {**replica, "graceful_shutdown_wait_loop_s": TEST_WAIT_LOOP_S}}


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
    whatever ran before; repeated calls with equal args reuse the running app. Replicas stop
    after ``TEST_WAIT_LOOP_S`` of Serve's wait loop, not its 2 s, unless ``args`` set it."""
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
            serve.run(build_app(_with_short_wait_loop(args)), name="ditserve", route_prefix="/")
            current["args"] = args
        return ray_cluster["url"]

    return _deploy
