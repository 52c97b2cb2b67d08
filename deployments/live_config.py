"""Serve ``user_config`` updates of running replicas: applied, or refused with the settings in
force kept.

Serve calls a deployment's ``reconfigure(user_config)`` when its replica starts and again on
every ``serve deploy`` that changes only ``user_config`` (no restart). When that call raises on
a running replica, Serve stops the replica and marks the deployment ``DEPLOY_FAILED`` with none
left: one mistyped knob (``max_batch_size: 0``, an adapter file that is not one) took the whole
app down. So an update a running replica cannot apply is refused instead: its settings stay as
they were, the refusal is logged (ERROR) and shown in ``GET /v1/stats``
(``live_update_refused``) until an update applies. At start, a bad ``user_config`` still
raises: the deploy fails, as with bad ``args``, so a replica that starts later (autoscaling, a
replacement) with a config that was refused while others ran refuses to start, until the
config is fixed.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Callable

from pydantic import ValidationError

from deployments.config import validation_line

logger = logging.getLogger("ray.serve")


class LiveUpdates:
    """One replica's ``user_config`` updates (see the module docstring).

    ``deployment``: its name, for the log. ``serving``: set by :meth:`started` from the
    replica's ``check_health`` (Serve runs it right after the start's ``reconfigure``).
    ``refused``: ``{"error", "at"}`` (a message and a Unix time, s) of the last update refused
    since the last one applied, else None."""

    def __init__(self, deployment: str):
        self.deployment = deployment
        self.serving = False
        self.refused: dict[str, Any] | None = None

    def started(self) -> None:
        self.serving = True

    async def apply(self, user_config: Any, apply: Callable[[Any], Any]) -> None:
        """Run ``apply(user_config)`` (a function or a coroutine function), which raises
        ``ValueError`` for what it did not apply: the Router and the Ingress check everything
        before changing anything, DiTReplica takes the adapters that fit and raises naming the
        others. Raises what it raises while the replica is starting; afterwards a ``ValueError``
        (pydantic's ``ValidationError`` is one) is logged and kept in :attr:`refused` instead."""
        try:
            done = apply(user_config)
            if inspect.isawaitable(done):
                await done
        except ValueError as exc:
            if not self.serving:
                raise
            # pydantic's runs to many lines
            said = validation_line(exc) if isinstance(exc, ValidationError) else str(exc)
            self.refused = {"error": said, "at": time.time()}
            logger.error("%s: the user_config update was refused; the settings in force stay: %s",
                         self.deployment, said)
            return
        self.refused = None
