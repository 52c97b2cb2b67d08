"""``build_app(args)``: the one builder behind ``serve run configs/x.yaml``, the CLI and the tests."""

from __future__ import annotations

import inspect
import math
import warnings

from pydantic import ValidationError
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from deployments.autoscaling import autoscaling_config
from deployments.config import (AppConfig, admission_limit_of, app_config, batching_update, check_user_config_shape,
                                MIN_METRICS_INTERVAL_S, ingress_update, look_back_problem, lora_registry,
                                validation_line)
from deployments.ingress import INGRESS_SPARE_SLOTS, Ingress
from deployments.replica import DiTReplica
from deployments.replica_chooser import ReplicaSetWatcher, StateAffinityReplicaChooser
from deployments.router import Router

SHUTDOWN_STEP_S = 5.0  # seconds between the stops of DiTReplica, Router and Ingress
# Backpressure in front of the Router. The Ingress takes as many requests at once as the app
# admits (admission_limit, the Router refusing beyond it) and INGRESS_SPARE_SLOTS more; at most
# as many more (at least INGRESS_PROXY_QUEUE: ingress_slots) wait at the door, in Serve's proxy or a caller's handle,
# for a slot; past that Serve's proxy refuses (429 + Retry-After, made an envelope by
# deployments.proxy). Once the proxy's AdmissionGate has seen the app's limit in an answer, it
# refuses at admission_limit itself, before Serve asks the Ingress replica (the cheaper refusal);
# the door still applies until then and for the app's paths the gate leaves alone (/health, the
# page). Under overload, polls and stats wait or are refused the same way. A live user_config
# change of the Router's limit reaches the gate through the Ingress (Ingress._follow_admission_limit),
# up to these slots; raising it beyond them needs the Ingress's max_ongoing_requests raised too.
# (Not a tiny queue: Serve counts requests that arrive together and are still being assigned as
# queued, so it would refuse bursts the Ingress has room for.)
INGRESS_PROXY_QUEUE = 32
# Serve sees a dead replica only at its next health check (every 0.9-1.1 x the period): the app's
# sole Router or Ingress gone, every request fails until then. Serve's default is 10 s; a check
# of these light actors is one small RPC (the DiTReplica's default, replica.health_check_period_s,
# is 2 s too).
ROUTING_HEALTH_CHECK_PERIOD_S = 2.0


def admission_limit(config: AppConfig) -> int:
    """Requests the app holds at once: ``max_queued_requests`` plus a full batch per replica
    (the most replicas autoscaling may start). The Ingress's ``max_ongoing_requests`` is sized
    from it; its answers name it for the proxy's gate until the Router's live knobs replace it."""
    return admission_limit_of(config.batching.max_queued_requests, config.batching.max_batch_size,
                              config.replica.most_replicas)


def ingress_slots(limit: int) -> dict[str, int]:
    """The Ingress's Serve options for an app admitting ``limit`` requests at once:
    ``max_ongoing_requests`` ``limit`` + :data:`~deployments.ingress.INGRESS_SPARE_SLOTS`, and
    ``max_queued_requests`` as many (at least :data:`INGRESS_PROXY_QUEUE`). Serve counts a
    caller's requests as queued until each is assigned a slot, per caller's handle: a burst of
    handle calls from one Ray job (or HTTP requests through one proxy) larger than
    ``max_queued_requests`` gets Serve's ``BackPressureError`` (HTTP: 429) for the excess before
    the Router sees it. With 32, a burst of 60 handle calls to an app admitting 72 lost 28 that
    way; sized like the slots, only a burst beyond what the app admits can, where the Router
    answers ``OverloadedError`` (429) for the rest anyway."""
    slots = limit + INGRESS_SPARE_SLOTS
    return {"max_ongoing_requests": slots, "max_queued_requests": max(INGRESS_PROXY_QUEUE, slots)}


def replica_counts(options: dict, config: AppConfig) -> tuple[int, int]:
    """``(initial, most)``: DiTReplicas at start and at most under DiTReplica's Serve ``options``
    (``num_replicas``, or ``autoscaling_config``'s ``initial_replicas`` / ``min_replicas`` and
    ``max_replicas``, Serve's defaults where unset), so a config file's ``deployments`` entry
    that sets them sizes admission as ``args`` would; ``config.replica``'s counts when neither
    is given."""
    autoscaling = options.get("autoscaling_config")
    if options.get("num_replicas") == "auto":  # Serve's defaults for "auto", updated by autoscaling_config
        given = (autoscaling.model_dump(exclude_unset=True) if isinstance(autoscaling, AutoscalingConfig)
                 else autoscaling or {})
        autoscaling = {**AutoscalingConfig.default().model_dump(), **given}
    if autoscaling is not None:
        if not isinstance(autoscaling, AutoscalingConfig):
            autoscaling = AutoscalingConfig(**autoscaling)
        return autoscaling.initial_replicas or autoscaling.min_replicas, autoscaling.max_replicas
    count = options.get("num_replicas")
    if isinstance(count, int) and count > 0:
        return count, count
    return config.replica.initial_replicas, config.replica.most_replicas


def deployment_options(config: AppConfig) -> dict[str, dict]:
    """The Serve options ``build_app`` gives each deployment, by deployment name.

    DiTReplica: its request router (the state-affinity chooser when ``batching.affinity``, else
    Serve's default one, watched: ``ReplicaSetWatcher``),
    replica count or autoscaling on the Router's queue, and with ``world_size > 1`` one
    placement-group bundle per rank (``STRICT_PACK``; the replica actor, rank 0, takes bundle 0
    and its resources). Router, Ingress and DiTReplica: their ``user_config`` (batching knobs;
    acceleration defaults and the LoRA registry; the LoRA registry), which Serve applies to
    running replicas without restarting them. Graceful
    shutdown: ``replica.graceful_shutdown_timeout_s`` for DiTReplica, staggered after it for the
    Router and then the Ingress, which outlives the Router to answer for it.
    """
    batching = config.batching
    if batching.affinity:
        router_config = RequestRouterConfig(request_router_class=StateAffinityReplicaChooser,
                                            request_routing_stats_period_s=batching.routing_stats_period_s)
    else:
        router_config = RequestRouterConfig(request_router_class=ReplicaSetWatcher,
                                            request_routing_stats_period_s=batching.routing_stats_period_s)
    grace = config.replica.graceful_shutdown_timeout_s
    wait_loop = config.replica.graceful_shutdown_wait_loop_s
    replica = {"ray_actor_options": config.replica.ray_actor_options, "request_router_config": router_config,
               "graceful_shutdown_timeout_s": grace, "graceful_shutdown_wait_loop_s": wait_loop,
               "health_check_period_s": config.replica.health_check_period_s,
               "health_check_timeout_s": config.replica.health_check_timeout_s}
    if config.replica.max_constructor_retry_count is not None:
        replica["max_constructor_retry_count"] = config.replica.max_constructor_retry_count
    if config.replica.autoscaling is None:
        replica["num_replicas"] = config.replica.num_replicas
    else:  # Serve scales DiTReplica on the Router's queue depth (deployments/autoscaling.py)
        autoscaling = config.replica.autoscaling
        replica["autoscaling_config"] = autoscaling_config(
            autoscaling.model_dump(), autoscaling.target_queued_per_replica or batching.max_batch_size)
    if config.parallel.world_size > 1:
        bundle = dict(config.replica.rank_resources)
        replica["placement_group_bundles"] = [bundle] * config.parallel.world_size
        replica["placement_group_strategy"] = "STRICT_PACK"
        replica["ray_actor_options"] = {**config.replica.ray_actor_options, "num_cpus": bundle.get("CPU", 0),
                                        "num_gpus": bundle.get("GPU", 0)}
    # Shutdown order (Serve stops all three at once, each killed after its own timeout): the
    # running batch finishes (grace), then the Router goes, and the Ingress, still up, answers
    # the requests the Router held with 503 "unavailable" (on an app delete the Router answers
    # its queued ones itself first: Router._answer_queued_if_unservable).
    loras = {name: settings.model_dump() for name, settings in config.model.loras.items()}
    replica["user_config"] = {"loras": loras}
    # The routing processes allocate with the C allocator: what a burst leaves free is returned
    # by malloc_trim once idle (deployments/memory.py), where pymalloc's partly used arenas kept
    # the Ingress ~12 % above its baseline after bench/overload.py's burst.
    light = {"num_cpus": 0, "runtime_env": {"env_vars": {"PYTHONMALLOC": "malloc"}}}
    return {"DiTReplica": replica,
            "Router": {"user_config": batching.model_dump(), "graceful_shutdown_timeout_s": grace + SHUTDOWN_STEP_S,
                       "graceful_shutdown_wait_loop_s": wait_loop,
                       "ray_actor_options": light, "health_check_period_s": ROUTING_HEALTH_CHECK_PERIOD_S},
            "Ingress": {"ray_actor_options": light, "health_check_period_s": ROUTING_HEALTH_CHECK_PERIOD_S,
                        "user_config": {"acceleration": config.acceleration.model_dump(), "loras": loras},
                        "graceful_shutdown_timeout_s": grace + 2 * SHUTDOWN_STEP_S,
                        "graceful_shutdown_wait_loop_s": wait_loop,
                        **ingress_slots(admission_limit(config)),
                        "backpressure_config": {"status_code": 429, "retry_after_s": 1}}}


def build_app(args: dict | AppConfig | None = None) -> Application:
    """Validate ``args`` (see ``deployments.config.AppConfig``) and bind the three deployments:
    Ingress → Router → DiTReplica. ``DITSERVE_*`` environment variables override the
    acceleration defaults (see ``AccelerationConfig``). Raises ``pydantic.ValidationError``
    on a bad config. (Serve's application builder: exactly one parameter.)"""
    return bind_app(args)


MAX_ONGOING_REQUESTS = 2**31 - 1  # Serve keeps max_ongoing_requests as a 32-bit integer


def check_replicas_come_back(options: dict) -> None:
    """Raise ``ValueError`` for DiTReplica Serve ``options`` that may scale it to zero
    (``autoscaling_config.min_replicas`` 0, as a ``deployments`` entry may give it; ``args``
    refuse it): the Router sends nothing while no replica exists, so Serve would see no demand
    and never start one again; every request would wait for its ``timeout_s``."""
    autoscaling = options.get("autoscaling_config")
    if autoscaling is None:
        return
    least = (autoscaling.get("min_replicas", 1) if isinstance(autoscaling, dict)
             else getattr(autoscaling, "min_replicas", 1))
    if least is not None and least < 1:
        raise ValueError(f"deployments: DiTReplica's autoscaling_config.min_replicas must be at least 1, got {least}: "
                         "the Router holds requests until a replica exists, so Serve would see no demand and never "
                         "scale up from zero")


def check_entry_look_back(name: str, given) -> None:
    """Raise ``ValueError`` naming the deployment for a ``deployments`` entry's
    ``autoscaling_config`` that Serve's ``AutoscalingConfig`` refuses, or whose
    ``look_back_period_s`` is not longer than its ``metrics_interval_s`` as Serve reads them
    (``"1e1"``, as YAML reads ``1e1``, and ``true`` are numbers to Serve; its defaults where one
    is left out): Serve only warns of that (a FutureWarning: it will refuse it)."""
    if not isinstance(given, dict):
        return
    fields = {key: value for key, value in given.items() if key != "target_queued_per_replica"}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`look_back_period_s`", category=FutureWarning)
        try:
            parsed = AutoscalingConfig(**fields)
        except ValidationError as exc:
            raise ValueError(f"deployments: {name}'s autoscaling_config: {validation_line(exc)}") from None
    problem = look_back_problem(parsed.look_back_period_s, parsed.metrics_interval_s)
    if problem:
        raise ValueError(f"deployments: {name}'s autoscaling_config.{problem}")
    if name == "DiTReplica" and parsed.metrics_interval_s < MIN_METRICS_INTERVAL_S:  # as args' (helper-65)
        raise ValueError(f"deployments: DiTReplica's autoscaling_config.metrics_interval_s must be at least "
                         f"{MIN_METRICS_INTERVAL_S} s (each report asks the Router for its queue), got "
                         f"{parsed.metrics_interval_s:g}")


def _with_router_queue_policy(name: str, entry: dict, config: AppConfig) -> dict:
    """``entry`` with a DiTReplica ``autoscaling_config`` that names no ``policy`` (or
    ``num_replicas: "auto"`` with none: Serve's "auto" defaults) given the
    Router-queue one (``RouterQueuePolicy``: its ``target_queued_per_replica``, else ``args``',
    else ``max_batch_size``): Serve's default policy counts ongoing requests, and a DiTReplica
    takes one batch at a time. Raises ``ValueError`` for a bad target, pydantic's
    ``ValidationError`` for bad Serve fields."""
    given = entry.get("autoscaling_config")
    if name == "DiTReplica" and entry.get("num_replicas") == "auto" and given is None:
        given = {}  # Serve's "auto" defaults, scaling on the Router's queue like an entry naming no policy
    if name != "DiTReplica" or not isinstance(given, dict):
        return entry
    if given.get("policy") is not None:
        _check_policy(given)
        return entry
    target = given.get("target_queued_per_replica")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not (math.isfinite(target) and target > 0)):
        raise ValueError(f"deployments: DiTReplica's autoscaling_config.target_queued_per_replica must be "
                         f"a finite number > 0 (images queued per replica), got {target!r}")
    if target is None and config.replica.autoscaling is not None:
        target = config.replica.autoscaling.target_queued_per_replica
    fields = {k: v for k, v in given.items() if k != "policy"}
    return {**entry, "autoscaling_config": autoscaling_config(fields, target or config.batching.max_batch_size)}


def _check_policy(given: dict) -> None:
    """Raise ``ValueError`` where Serve's controller could not make an ``autoscaling_config``'s
    ``policy``: a class policy (``RouterQueuePolicy`` among them) is made once, from its
    ``policy_kwargs``, as Serve makes it (``_resolve_policy_callable``); raising there, it left
    the controller retrying every 100 ms and the deploy never ending (helper-64). A
    ``target_queued_per_replica`` beside a policy was dropped without a word: refused."""
    if given.get("target_queued_per_replica") is not None:
        raise ValueError("deployments: DiTReplica's autoscaling_config gives target_queued_per_replica and a policy; "
                         "give one: target_queued_per_replica is ditserve's policy's (RouterQueuePolicy's) target")
    policy = AutoscalingConfig(**given).policy
    made = policy.get_policy()
    if inspect.isclass(made):
        try:
            made(**policy.policy_kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever the policy's constructor raises, Serve's would too
            raise ValueError(f"deployments: DiTReplica's autoscaling_config.policy: {made.__name__}(**policy_kwargs) "
                             f"with policy_kwargs={policy.policy_kwargs!r} raised {type(exc).__name__}: "
                             f"{exc}") from None


def check_entry_user_config(name: str, user_config, config: AppConfig) -> None:
    """Check a ``deployments`` entry's ``user_config`` as the deployment would at start (where
    a bad one fails the deploy with a replica's traceback): the Router's batching knobs over
    ``args``' (``BatchingConfig``), the Ingress's acceleration defaults over ``args``'
    (``AccelerationConfig``) and adapter registry, DiTReplica's adapter registry, and the keys
    each reads (``check_user_config_shape``). Raises ``ValueError`` naming the deployment and the
    field."""
    if user_config is None:
        return
    try:
        check_user_config_shape(name, user_config)
    except ValueError as exc:
        raise ValueError(f"deployments: {name}'s {exc}") from None
    try:
        if name == "Router":
            batching_update(config.batching.model_dump(), user_config, config.limits.model_dump(),
                            config.model.known_video())
        elif name == "Ingress":
            ingress_update(user_config, config.acceleration.model_dump(), config.model.device, config.model.dtype,
                           config.parallel.ring_degree, config.limits.default_steps)
        elif name == "DiTReplica":
            lora_registry(user_config.get("loras") or {})
    except ValidationError as exc:
        raise ValueError(f"deployments: {name}'s user_config: {validation_line(exc)}") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"deployments: {name}'s user_config: {exc}") from None


def check_same_loras(deployments, config: AppConfig) -> None:
    """Refuse ``deployments`` entries whose ``user_config`` gives the Ingress and DiTReplica
    different adapter registries (one left out keeps ``model.loras``): the Ingress admits
    requests by its registry and DiTReplica checks the adapters against the model, so an
    adapter only the Ingress had was never checked (its requests failed 500
    ``lora_load_failed``) and one only DiTReplica had could not be named. Raises
    ``ValueError`` naming the adapters that differ."""
    registries = {}
    for name in ("Ingress", "DiTReplica"):
        user_config = next((e.get("user_config") for e in deployments if e.get("name") == name), None) or {}
        loras = user_config.get("loras") if isinstance(user_config, dict) else None
        registries[name] = lora_registry(config.model.loras if loras is None else loras)
    ingress, replica = registries["Ingress"], registries["DiTReplica"]
    differ = sorted(n for n in {*ingress, *replica} if ingress.get(n) != replica.get(n))
    if differ:
        raise ValueError(f"deployments: the Ingress's and DiTReplica's adapter registries (user_config.loras, else "
                         f"model.loras) differ at {', '.join(differ)}: give both the same loras")


def bind_app(args: dict | AppConfig | None = None, deployments: list[dict] | None = None) -> Application:
    """:func:`build_app` with ``deployments``: a Serve config file's ``deployments`` entries
    (``{"name": ..., option: value}``, Serve's ``DeploymentSchema``), each option replacing the
    one built here, as Serve applies them to an ``import_path`` app (for ``ditserve serve
    --config``, which deploys in-process). Raises ``pydantic.ValidationError`` on a bad config,
    ``ValueError`` for an entry naming no deployment of the app or one named twice (Serve
    would take the last entry and drop the other's options without a word), and for a Router
    entry giving it more than one replica."""
    config = args if isinstance(args, AppConfig) else app_config(args or {})
    options = deployment_options(config)
    names = [entry.get("name") for entry in deployments or ()]
    twice = sorted({str(name) for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"deployments: {', '.join(twice)} {'has' if len(twice) == 1 else 'have'} more than one "
                         "entry; give each deployment's options in one")
    for entry in deployments or ():
        entry = dict(entry)
        name = entry.pop("name")
        if name not in options:
            raise ValueError(f"deployments: no deployment named {name!r} in this application; it has "
                             f"{', '.join(sorted(options))}")
        if name == "Router" and (entry.get("num_replicas", 1) != 1 or entry.get("autoscaling_config")):
            # its queues, counters and video jobs are its own: a second Router's jobs 404 on the first
            raise ValueError("deployments: Router runs as one replica (it holds the queues and the video jobs); "
                             "drop its num_replicas / autoscaling_config (scale DiTReplica, or the Ingress)")
        check_entry_user_config(name, entry.get("user_config"), config)
        check_entry_look_back(name, entry.get("autoscaling_config"))
        try:
            entry = _with_router_queue_policy(name, entry, config)
        except ValidationError as exc:
            raise ValueError(f"deployments: {name}'s autoscaling_config: {validation_line(exc)}") from None
        built = dict(options[name])
        if "autoscaling_config" in entry or entry.get("num_replicas") == "auto":
            built.pop("num_replicas", None)  # Serve takes the entry's count over the built one, either way
        elif "num_replicas" in entry:
            built.pop("autoscaling_config", None)
        options[name] = {**built, **entry}
    check_same_loras(deployments or (), config)
    bundles = options["DiTReplica"].get("placement_group_bundles")
    if config.parallel.world_size > 1 and len(bundles or ()) != config.parallel.world_size:  # the rank group's check
        raise ValueError(f"deployments: DiTReplica's placement_group_bundles has {len(bundles or ())} bundle(s); "
                         f"world_size={config.parallel.world_size} (args.parallel) needs one per rank; leave it "
                         "out to have it built from replica.rank_resources")
    try:
        initial_replicas, most_replicas = replica_counts(options["DiTReplica"], config)
    except ValidationError as exc:
        raise ValueError(f"deployments: DiTReplica's autoscaling_config: {validation_line(exc)}") from None
    check_replicas_come_back(options["DiTReplica"])
    limit = admission_limit_of(config.batching.max_queued_requests, config.batching.max_batch_size, most_replicas)
    if limit + INGRESS_SPARE_SLOTS > MAX_ONGOING_REQUESTS:
        raise ValueError(f"the admission limit, batching.max_queued_requests {config.batching.max_queued_requests} + "
                         f"batching.max_batch_size {config.batching.max_batch_size} x {most_replicas} DiTReplicas at "
                         f"most (num_replicas / autoscaling max_replicas), is {limit}: more requests than Serve's "
                         f"max_ongoing_requests holds ({MAX_ONGOING_REQUESTS}); give fewer replicas or a smaller batch")
    router = [entry["max_ongoing_requests"] for entry in deployments or ()
              if entry["name"] == "Router" and entry.get("max_ongoing_requests") is not None]
    if router and router[0] < limit + INGRESS_SPARE_SLOTS:
        # helper-64: max_ongoing_requests 1 ran every request alone, batch sizes [1, 1, ...]
        raise ValueError(f"deployments: Router's max_ongoing_requests {router[0]} is below "
                         f"{limit + INGRESS_SPARE_SLOTS}: the {limit} requests the application admits and "
                         f"{INGRESS_SPARE_SLOTS} stats and health calls; the ones over it wait at the Router's door, "
                         "where no batch forms of them; leave it out")
    given = {key for entry in deployments or () if entry["name"] == "Ingress" for key in entry}
    # sized again: a DiTReplica count given there changes the limit; an Ingress entry's own values
    # stand, and its max_ongoing_requests (a limit raised live, README) sizes the queue at its door
    slots = ingress_slots(limit)
    if "max_ongoing_requests" in given:
        slots["max_queued_requests"] = max(INGRESS_PROXY_QUEUE, int(options["Ingress"]["max_ongoing_requests"]))
    options["Ingress"].update({key: value for key, value in slots.items() if key not in given})
    acceleration = config.acceleration.model_dump()
    if not (acceleration["torch_compile"] or acceleration["warmup"]):
        # Request defaults live in the ingress (live-reconfigurable); the replica needs its kernel only.
        acceleration = {k: acceleration[k] for k in ("attention_backend", "torch_compile", "compile_backend",
                                                     "warmup")}
    replica = DiTReplica.options(**options["DiTReplica"]).bind(
        config.model.model_dump(), config.replica.torch_threads, acceleration, config.limits.model_dump(),
        config.parallel.model_dump(), config.replica.rank_resources, config.replica.cpu_nice,
        config.batching.model_dump())
    router = Router.options(**options["Router"]).bind(replica, initial_replicas, config.videos.model_dump(),
                                                      config.replica.routing_nice, config.batching.model_dump(),
                                                      config.limits.model_dump(), config.model.known_video())
    ingress_config = {**config.model_dump(exclude={"acceleration", "batching", "videos"}),
                      # args' request defaults: what an acceleration user_config leaves out keeps
                      "acceleration": config.acceleration.model_dump(),
                      "admission_limit": limit,  # what the proxy's AdmissionGate admits
                      "most_replicas": most_replicas,  # for the live limit (Router's knobs)
                      "routing_nice": config.replica.routing_nice}
    return Ingress.options(**options["Ingress"]).bind(router, ingress_config)
