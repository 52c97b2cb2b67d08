"""Ray Serve's private APIs that ditserve uses, in one place (tested range: ``TESTED``).

Imported only by ``deployments/`` and the tests. A ``RequestRouter`` knows its deployment only
as the private ``_deployment_id`` (the public ``app_name`` gives just the application), and
deploying a Serve config file in-process (what ``serve deploy`` does over the dashboard's REST
API) is the private client's ``deploy_apps``.
"""

from __future__ import annotations

import os

from compat import CompatError, Reliance, missing

DISTRIBUTION = "ray"
TESTED = ">=2.60,<2.61"

RELIES_ON = (
    Reliance("ray.serve.request_router", "RequestRouter", "the replica-choice extension point"),
    Reliance("ray.serve.context", "_get_global_client",
             "deploying a config file in-process (tests); whether Serve runs and its HTTP options"),
    Reliance("ray.serve._private.request_router.pow_2_router", "PowerOfTwoChoicesRequestRouter",
             "Serve's default request router, subclassed to watch the replica set with affinity off"),
    Reliance("ray.serve.context", "ReplicaContext",
             "a replica's live deployment options (its private _deployment_config: max_ongoing_requests, "
             "num_replicas, autoscaling_config)"),
    Reliance("ray._raylet", "GcsClient",
             "asking a cluster once whether it refuses this process's token (ray.init retries for ~20 s)"),
)


def check() -> list[str]:
    """What the installed Ray lacks of :data:`RELIES_ON` (empty: nothing)."""
    return missing(DISTRIBUTION, TESTED, RELIES_ON)


def deployment_name(router) -> str:
    """The name of the deployment a ``RequestRouter`` routes to (its private ``_deployment_id``).
    Raises :class:`CompatError` when the router has none."""
    try:
        return router._deployment_id.name
    except AttributeError as exc:
        raise CompatError(f"Ray Serve's RequestRouter no longer has _deployment_id ({exc}); ditserve is tested "
                          f"with ray{TESTED}") from None


def deploy_config(config, wait_running: bool = True) -> None:
    """Deploy a ``ServeDeploySchema`` on the connected cluster as ``serve deploy`` would. With
    ``wait_running``, wait until every application in it is ``RUNNING`` (Serve raises
    ``TimeoutError`` after 60 s), else return once the controller has taken the config."""
    from ray.serve.context import _get_global_client

    _get_global_client().deploy_apps(config, _blocking=wait_running)


def http_options() -> dict:
    """``{"host", "port"}`` the connected cluster's Serve proxies listen on (``serve.start`` keeps
    a running Serve's options and only logs a warning when asked for others). Raises
    :class:`CompatError` when Serve's client has no ``http_config``."""
    from ray.serve.context import _get_global_client

    try:
        config = _get_global_client().http_config
        return {"host": config.host, "port": config.port}
    except AttributeError as exc:
        raise CompatError(f"Ray Serve's client no longer has http_config ({exc}); ditserve is tested "
                          f"with ray{TESTED}") from None


def serve_running() -> bool:
    """Whether Serve's controller runs in the connected cluster (``serve.status()`` answers the
    same empty status before Serve starts as for a Serve without applications)."""
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False) is not None


def power_of_two_choices_router() -> type:
    """Serve's default request router class (``PowerOfTwoChoicesRequestRouter``, private: the
    public ``ray.serve.request_router`` exports only its mixins). Raises :class:`CompatError`
    when Ray no longer has it."""
    try:
        from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
    except ImportError as exc:
        raise CompatError(f"Ray Serve no longer has PowerOfTwoChoicesRequestRouter ({exc}); ditserve is tested "
                          f"with ray{TESTED}") from None
    return PowerOfTwoChoicesRequestRouter


def _deployment_config():
    """The calling replica's private ``DeploymentConfig`` as Serve runs it now."""
    from ray import serve

    try:
        return serve.get_replica_context()._deployment_config
    except AttributeError as exc:
        raise CompatError(f"Ray Serve's ReplicaContext no longer has _deployment_config ({exc}); ditserve is "
                          f"tested with ray{TESTED}") from None


def delete_app(name: str, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Delete application ``name`` and wait while Serve deletes it (polling every ``poll_s``
    seconds), up to ``timeout_s`` seconds (give
    the replicas' ``graceful_shutdown_timeout_s`` and a margin). ``serve.delete`` gives up after
    a fixed 60 s with ``TimeoutError`` while the deletion goes on: a batch running at Ctrl-C
    that outlasted it ended ``ditserve serve`` with a traceback and exit 1. Its
    ``_blocking=False`` is the same call without that wait. Returns False when the app is still
    there at the deadline or no longer being deleted (someone deployed it again meanwhile)."""
    import time

    from ray import serve
    from ray.serve.schema import ApplicationStatus

    serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    deleting = False  # the controller takes the delete asynchronously: the app reads RUNNING at first
    while (app := serve.status().applications.get(name)) is not None and app.status != ApplicationStatus.NOT_STARTED:
        if app.status == ApplicationStatus.DELETING:
            deleting = True
        elif deleting:  # deployed again after its deletion began
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def max_ongoing_requests() -> int:
    """The calling replica's ``max_ongoing_requests`` as Serve runs it now (a config file's
    ``deployments`` section changes it without restarting the replica: Serve reconfigures the
    running replica and its context). Only inside a replica. Raises :class:`CompatError` when
    the replica context has no ``_deployment_config``."""
    return _deployment_config().max_ongoing_requests


def most_replicas() -> int:
    """The calling replica's deployment's replica count at most, as Serve runs it now: its
    ``autoscaling_config``'s ``max_replicas``, else ``num_replicas``. Only inside a replica.
    Raises :class:`CompatError` as :func:`max_ongoing_requests`."""
    config = _deployment_config()
    return config.autoscaling_config.max_replicas if config.autoscaling_config else config.num_replicas


def gcs_refusal(address: str, timeout_s: float = 5.0) -> str | None:
    """Ray's reason (one line) when the GCS at ``address`` (``HOST:PORT``) refuses this
    process's credentials (token authentication: a missing or wrong token), else ``None``, also
    when it cannot tell within ``timeout_s`` seconds (``ray.init`` then reports what it finds).

    ``ray.init`` connects as Ray's ``Node`` does (``ray._private.node``): a private
    ``GcsClient`` per attempt, 20 attempts a second apart, and then says only that it failed to
    connect; this makes one such attempt. Raises :class:`CompatError` if Ray has no
    ``GcsClient`` any more."""
    import threading

    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError as exc:
        raise CompatError(f"Ray no longer has ray._raylet.GcsClient or ray.exceptions.AuthenticationError ({exc}); "
                          f"ditserve is tested with ray{TESTED}") from None
    refused: list[str] = []

    def attempt() -> None:  # a TCP server that is not a GCS holds the client ~40 s: not waited for
        try:
            GcsClient(address=address)
        except AuthenticationError as exc:
            refused.append((str(exc.message).strip().splitlines() or [type(exc).__name__])[0])
        except Exception:  # noqa: BLE001 - anything else is ray.init's to report
            pass

    prober = threading.Thread(target=attempt, name="ditserve-gcs-probe", daemon=True)
    # Ray's C++ client logs its refusal to stderr ("gcs_client.cc:...: Failed to get cluster ID
    # ...") above the caller's one line (helper-81): its descriptor points at /dev/null meanwhile
    try:
        saved = os.dup(2)
    except OSError:  # no stderr (closed): nothing to keep quiet
        saved = None
    try:
        if saved is not None:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        prober.start()
        prober.join(timeout_s)
    finally:
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)
    return refused[0] if refused else None
