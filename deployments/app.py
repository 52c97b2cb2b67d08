"""``build_app(args)``: the one builder behind ``serve run configs/x.yaml``, the CLI and the tests."""

from __future__ import annotations

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.config import AppConfig, with_env_overrides
from deployments.ingress import Ingress
from deployments.replica import DiTReplica
from deployments.request_router import SignatureAffinityRouter
from deployments.router import Router


def build_app(args: dict | AppConfig | None = None) -> Application:
    """Validate ``args`` (see ``deployments.config.AppConfig``) and bind the three deployments:
    Ingress → Router → DiTReplica. ``DITSERVE_*`` environment variables override the
    acceleration defaults (see ``AccelerationConfig``). Raises ``pydantic.ValidationError``
    on a bad config."""
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(with_env_overrides(args or {}))
    batching = config.batching
    router_config = RequestRouterConfig(request_routing_stats_period_s=batching.routing_stats_period_s)
    if batching.affinity:
        router_config = RequestRouterConfig(request_router_class=SignatureAffinityRouter,
                                            request_routing_stats_period_s=batching.routing_stats_period_s)
    world_size = config.parallel.ulysses_degree * config.parallel.ring_degree
    options = {"num_replicas": config.replica.num_replicas, "ray_actor_options": config.replica.ray_actor_options,
               "request_router_config": router_config}
    if world_size > 1:  # one bundle per rank; the replica actor (rank 0) takes bundle 0
        bundle = dict(config.replica.rank_resources)
        options["placement_group_bundles"] = [bundle] * world_size
        options["placement_group_strategy"] = "STRICT_PACK"
        options["ray_actor_options"] = {**config.replica.ray_actor_options, "num_cpus": bundle.get("CPU", 0),
                                        "num_gpus": bundle.get("GPU", 0)}
    replica = DiTReplica.options(**options).bind(
        config.model.model_dump(), config.replica.torch_threads, config.acceleration.model_dump(),
        config.limits.model_dump(), config.parallel.model_dump(), config.replica.rank_resources)
    router = Router.bind(replica, batching.model_dump(), config.replica.num_replicas)
    return Ingress.bind(router, config.model_dump())
