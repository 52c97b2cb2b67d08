"""Handles a deployment uses to call another of the same application (public Serve API)."""

from __future__ import annotations

from typing import Any

from ray import serve

ROUTER_DEPLOYMENT = "Router"

_router_handles: dict[str, Any] = {}


def router_handle(app_name: str):
    """The ``Router`` deployment of application ``app_name`` (one handle per process)."""
    handle = _router_handles.get(app_name)
    if handle is None:
        handle = _router_handles[app_name] = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name)
    return handle
