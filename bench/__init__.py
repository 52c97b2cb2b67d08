"""Benchmarks: each prints its figures (ratios measured side by side in one run) and goals."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def local_serve(num_cpus: int) -> Iterator[int]:
    """A local Ray cluster (``num_cpus`` logical CPUs) with Serve's proxy on a free
    127.0.0.1 port and ditserve's error-envelope middleware in it; yields the port and shuts
    Serve and Ray down afterwards."""
    import ray
    from ray import serve

    from deployments.proxy import install as install_proxy_middleware
    from parallel.groups import free_port

    install_proxy_middleware()
    ray.init(num_cpus=num_cpus, log_to_driver=False, include_dashboard=False)
    port = free_port("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
