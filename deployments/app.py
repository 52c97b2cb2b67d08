"""``build_app(args)``: the one builder behind ``serve run configs/x.yaml``, the CLI and the tests."""

from __future__ import annotations

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.autoscaling import autoscaling_config
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
    options = {"ray_actor_options": config.replica.ray_actor_options, "request_router_config": router_config}
    if config.replica.autoscaling is None:
        options["num_replicas"] = config.replica.num_replicas
    else:  # Serve scales DiTReplica on the Router's queue depth (deployments/autoscaling.py)
        autoscaling = config.replica.autoscaling
        options["autoscaling_config"] = autoscaling_config(
            autoscaling.model_dump(), autoscaling.target_queued_per_replica or batching.max_batch_size)
    if world_size > 1:  # one bundle per rank; the replica actor (rank 0) takes bundle 0
        bundle = dict(config.replica.rank_resources)
        options["placement_group_bundles"] = [bundle] * world_size
        options["placement_group_strategy"] = "STRICT_PACK"
        options["ray_actor_options"] = {**config.replica.ray_actor_options, "num_cpus": bundle.get("CPU", 0),
                                        "num_gpus": bundle.get("GPU", 0)}
    acceleration = config.acceleration.model_dump()
    if not (acceleration["torch_compile"] or acceleration["warmup"]):
        # Request defaults live in the ingress (live-reconfigurable); the replica needs its kernel only.
        acceleration = {k: acceleration[k] for k in ("attention_backend", "torch_compile", "compile_backend",
                                                     "warmup")}
    replica_args = (config.model.model_dump(), config.replica.torch_threads, acceleration,
                    config.limits.model_dump(), config.parallel.model_dump(), config.replica.rank_resources)
    replica = DiTReplica.options(**options).bind(*replica_args)
    # Batching knobs and acceleration defaults are Serve user_configs: when a Serve config file
    # (serve deploy, RayService) changes only them, Serve reconfigures the running Router /
    # Ingress replicas instead of restarting them, and leaves the DiTReplicas alone.
    ingress_config = config.model_dump(exclude={"acceleration", "batching", "videos"})
    router = Router.options(user_config=batching.model_dump()).bind(replica, config.replica.initial_replicas,
                                                                    config.videos.model_dump())
    return Ingress.options(user_config=config.acceleration.model_dump()).bind(router, ingress_config)
