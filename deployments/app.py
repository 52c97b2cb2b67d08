"""``build_app(args)``: the one builder behind ``serve run configs/x.yaml``, the CLI and the tests."""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppConfig
from deployments.ingress import Ingress
from deployments.replica import DiTReplica
from deployments.router import Router


def build_app(args: dict | AppConfig | None = None) -> Application:
    """Validate ``args`` (see ``deployments.config.AppConfig``) and bind the three deployments:
    Ingress → Router → DiTReplica. Raises ``pydantic.ValidationError`` on a bad config."""
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    replica = DiTReplica.options(
        num_replicas=config.replica.num_replicas,
        ray_actor_options=config.replica.ray_actor_options,
    ).bind(config.model.model_dump(), config.replica.torch_threads)
    router = Router.bind(replica, config.batching.model_dump(), config.replica.num_replicas)
    return Ingress.bind(router, config.model_dump())
