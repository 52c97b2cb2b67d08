"""deployments.live_config: a bad user_config update fails a starting replica and is refused
(settings in force kept, the refusal recorded) on a running one."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from deployments.config import BatchingConfig
from deployments.live_config import LiveUpdates


def test_a_bad_update_fails_the_start_and_is_refused_once_serving():
    applied = []

    def apply(knobs: dict) -> None:
        applied.append(BatchingConfig.model_validate(knobs).max_batch_size)

    live = LiveUpdates("Router")
    with pytest.raises(ValidationError, match="max_batch_size"):
        asyncio.run(live.apply({"max_batch_size": 0}, apply))  # at start: the deploy fails
    asyncio.run(live.apply({"max_batch_size": 4}, apply))
    live.started()
    asyncio.run(live.apply({"max_batch_size": 0}, apply))  # serving: refused, not raised
    assert applied == [4] and "max_batch_size" in live.refused["error"] and live.refused["at"] > 0

    async def apply_later(knobs: dict) -> None:  # a coroutine function (DiTReplica's adapter checks)
        apply(knobs)

    asyncio.run(live.apply({"max_batch_size": 8}, apply_later))
    assert applied == [4, 8] and live.refused is None  # an update that applies clears the refusal


def test_a_router_deployment_with_no_replica_left_is_503_not_500():
    """A failed redeploy of the Router leaves its deployment without replicas: Serve's handle
    raises DeploymentUnavailableError, which a client gets as 503 ``unavailable`` (was a 500
    "internal error"), and ``/health`` answers the same."""
    from ray.serve.exceptions import DeploymentUnavailableError

    from deployments.http import as_ditserve_error

    error = as_ditserve_error(DeploymentUnavailableError("Router"))
    assert error.status_code == 503 and error.code == "unavailable" and "serve status" in error.message
