"""Autoscaling of the DiTReplica deployment on the Router's queue depth, through Ray Serve's own
custom-metric autoscaling.

Serve's default policy scales on requests ongoing at a deployment's replicas and queued at its
handles. That misses ditserve's real backlog: the Router forms a batch only when a replica can
take it (late binding), so waiting work sits in the Router's signature queues, invisible to the
DiTReplica handle. Ray Serve (2.60) lets a deployment export custom metrics through a
``record_autoscaling_stats`` method of its replicas and be scaled by a custom policy
(``AutoscalingConfig.policy``) that reads them from ``AutoscalingContext.aggregated_metrics``.
Serve collects custom metrics only from the scaled deployment's own replicas, so each
DiTReplica reports the Router's queue (:func:`router_queue_stats`, one handle call to
``Router.queue_depth``) and :class:`RouterQueuePolicy` turns it into a replica count. Serve's
controller then applies ``min_replicas`` / ``max_replicas``, ``upscale_delay_s`` /
``downscale_delay_s`` and the scaling factors, and starts or stops replicas (placement groups
included) as it does for any autoscaled deployment.
"""

from __future__ import annotations

import math
from typing import Any

from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from deployments.handles import router_handle

# Custom metric names, as DiTReplica reports them and RouterQueuePolicy reads them.
QUEUED_IMAGES = "router_queued_images"
QUEUED_REQUESTS = "router_queued_requests"
# the most replicas the policy asks for (Serve then bounds it by max_replicas)
MAX_DESIRED_REPLICAS = 1_000_000


async def router_queue_stats(app_name: str) -> dict[str, float]:
    """The Router's backlog, for ``DiTReplica.record_autoscaling_stats``.

    Returns ``{QUEUED_IMAGES: images, QUEUED_REQUESTS: requests}`` waiting in the Router of
    application ``app_name`` and not yet dispatched (a request counts ``n`` images). Raises
    whatever the handle call raises (Serve logs it and skips this sample).
    """
    depth = await router_handle(app_name).queue_depth.remote()
    return {QUEUED_IMAGES: float(depth["images"]), QUEUED_REQUESTS: float(depth["requests"])}


class RouterQueuePolicy:
    """Serve autoscaling policy: enough DiTReplicas that each has at most
    ``target_queued_per_replica`` images waiting in the Router, and never fewer than are busy.

    ``desired = max(ceil(queued_images / target_queued_per_replica), busy)`` where
    ``queued_images`` is the Router's backlog averaged over ``look_back_period_s`` (the largest
    report among the replicas: they all report the same Router) and ``busy`` is Serve's own
    count of batches running on (or queued at handles for) DiTReplicas, so a replica that is
    working is not removed just because the queue is empty. While no replica reported the
    backlog (the Router's ``queue_depth`` failed: Serve skips those samples) it holds at
    Serve's current target (more if more are busy): an unknown queue is not an empty one.
    Serve bounds the result by ``min_replicas`` / ``max_replicas`` and applies the
    up/down-scale delays. Raises ``ValueError`` for a target that is not a finite number > 0.
    """

    def __init__(self, target_queued_per_replica: float):
        if isinstance(target_queued_per_replica, bool) or not (  # true is no target (helper-65)
                math.isfinite(target_queued_per_replica) and target_queued_per_replica > 0):
            raise ValueError(f"target_queued_per_replica must be a finite number > 0, got {target_queued_per_replica}")
        self.target_queued_per_replica = float(target_queued_per_replica)

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        if ctx.current_num_replicas == 0:  # nothing reports the queue without a replica
            return ctx.target_num_replicas, {}
        reports = [v for v in ((ctx.aggregated_metrics or {}).get(QUEUED_IMAGES) or {}).values() if math.isfinite(v)]
        busy = ctx.total_num_requests if math.isfinite(ctx.total_num_requests) else 0
        if not reports:  # the backlog is unknown (the Router did not answer): hold, never scale down blind
            return max(ctx.target_num_replicas, math.ceil(busy)), {"queued_images": None, "busy": busy}
        queued = max(reports)
        # bounded: a tiny target (1e-310) made the ratio infinite, and math.ceil raised on every tick
        wanted = min(queued / self.target_queued_per_replica, MAX_DESIRED_REPLICAS)
        desired = max(math.ceil(wanted), math.ceil(busy))
        return desired, {"queued_images": queued, "busy": busy}


def autoscaling_config(settings: dict, target_queued_per_replica: float) -> AutoscalingConfig:
    """Ray Serve's ``AutoscalingConfig`` for DiTReplica from ``ReplicaConfig.autoscaling``
    (``deployments.config.AutoscalingSettings`` as a dict): Serve's own fields pass through,
    and the policy is :class:`RouterQueuePolicy` with ``target_queued_per_replica`` (images)."""
    ray_fields = {k: v for k, v in settings.items() if k != "target_queued_per_replica" and v is not None}
    policy = AutoscalingPolicy(policy_function=RouterQueuePolicy,
                               policy_kwargs={"target_queued_per_replica": target_queued_per_replica})
    return AutoscalingConfig(**ray_fields, policy=policy)
