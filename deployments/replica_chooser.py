"""StateAffinityReplicaChooser: picks the DiTReplica for a batch, inside Ray Serve's request routing.

It plugs into Serve's request-router extension point (``RequestRouter``, set as DiTReplica's
``request_router_config``). Replicas report the signature of the last batch they ran through
``record_routing_stats``; the chooser also remembers where it sent each batch (fresher than the
periodic stats). For a batch it ranks the replica the Router meant it for first, then the
replicas whose state matches the batch's signature, then all others; within a rank Serve takes
the least loaded replica that has room, and when every replica is full Serve's routing loop
backs off (``initial_backoff_s`` × ``backoff_multiplier``) instead of spinning.

The Router deployment that owns the DiTReplica handle runs in the same process as this
object; it reads :meth:`replica_views` to form batches only when a replica can take one.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from compat import ray_serve as compat
from deployments.scheduling import ReplicaView
from pipeline.wire import Batch

ROUTES_KEPT = 1024  # batch routes remembered, for a Router asking where a refused batch went
# (app name, deployment name) -> the live chooser of that deployment in this process.
_CHOOSERS: dict[tuple[str, str], "StateAffinityReplicaChooser"] = {}
# (app name, deployment name) -> the live request router of that deployment in this process,
# either kind (StateAffinityReplicaChooser, or ReplicaSetWatcher with affinity off).
_ROUTERS: dict[tuple[str, str], RequestRouter] = {}


def chooser_for(app_name: str, deployment_name: str) -> "StateAffinityReplicaChooser | None":
    return _CHOOSERS.get((app_name, deployment_name))


def replica_count(app_name: str, deployment_name: str) -> int | None:
    """How many replicas of the deployment its request router in this process can route to
    now; None before Serve has made that router (it does once the deployment's config reaches
    the handle, shortly after the Router starts)."""
    router = _ROUTERS.get((app_name, deployment_name))
    return None if router is None else len(router.curr_replicas)


def _register(router: RequestRouter, *, chooser: bool) -> None:
    # Serve may load these classes from a by-value pickle whose globals are a copy; register
    # in the module the Router deployment imports.
    import deployments.replica_chooser as registry

    key = (router.app_name, compat.deployment_name(router))
    registry._ROUTERS[key] = router
    if chooser:
        registry._CHOOSERS[key] = router


def adapters_refused_everywhere(app_name: str, deployment_name: str) -> frozenset[str]:
    """The adapter names every replica the deployment's request router in this process can
    route to refused at its last registry update (``loras_refused`` in their routing stats);
    empty while there is no replica, or one has not reported yet (a replica that just started
    may take an adapter the others refused)."""
    router = _ROUTERS.get((app_name, deployment_name))
    refused: frozenset[str] | None = None
    for replica in (router.curr_replicas.values() if router is not None else ()):
        stats = replica.routing_stats or {}
        if "loras_refused" not in stats:
            return frozenset()
        names = frozenset(stats["loras_refused"])
        refused = names if refused is None else refused & names
    return refused or frozenset()


def taking_adapters(candidate_replicas: list[RunningReplica], batch: "Batch | None") -> list[RunningReplica]:
    """The replicas that did not refuse an adapter ``batch`` names (``loras_refused`` in their
    routing stats, the names their last registry update refused); all of them when none is
    left. A replica that refused one answers the batch 400 ``adapter_refused``, where another
    may have taken it: an adapter file that reached some nodes only, or was fixed before a
    replica started. Seen once the replica's next routing stats arrive
    (``routing_stats_period_s``)."""
    if batch is None or not batch.requests or not batch.requests[0].lora:
        return candidate_replicas
    adapters = {spec.name for spec in batch.requests[0].lora}
    taking = [r for r in candidate_replicas
              if not adapters & set((r.routing_stats or {}).get("loras_refused") or ())]
    return taking or candidate_replicas  # refused everywhere: one answers why


class ReplicaSetWatcher(compat.power_of_two_choices_router()):
    """Serve's default request router (power of two choices) for DiTReplica with
    ``batching.affinity`` off, unchanged but for the replicas that refused a batch's adapter
    (:func:`taking_adapters`): registered so the Router sees its replica set
    (:func:`replica_count`) and holds its queues while every replica is gone."""

    def initialize_state(self, **kwargs):
        super().initialize_state(**kwargs)
        _register(self, chooser=False)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return await super().choose_replicas(taking_adapters(candidate_replicas, _batch_of(pending_request)),
                                             pending_request)


def _batch_of(pending_request: PendingRequest | None) -> Batch | None:
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg if isinstance(arg, Batch) else None


class StateAffinityReplicaChooser(FIFOMixin, RequestRouter):
    """Prefers a replica whose acceleration state already matches the batch's signature."""

    def initialize_state(self, **kwargs):
        self._routed_state: dict[ReplicaID, str] = {}
        self._routed_loras: dict[ReplicaID, frozenset[str]] = {}  # adapters of the last batch routed there
        self._inflight: dict[str, ReplicaID] = {}  # batch id -> the replica running it
        self._requests: dict[str, str] = {}  # Serve's internal request id -> batch id
        self._batch_replica: dict[str, ReplicaID] = {}  # batch id -> where it was routed (the newest)
        self._excluded: set[str] = set()  # replicas that refused work as broken (unique ids)
        _register(self, chooser=True)

    def last_signature_of(self, replica: RunningReplica) -> str | None:
        if replica.replica_id in self._routed_state:
            return self._routed_state[replica.replica_id]
        return (replica.routing_stats or {}).get("signature")

    def loaded_loras_of(self, replica: RunningReplica) -> frozenset[str]:
        """The LoRA adapters a replica holds: its last routing stats, plus the adapters of the
        last batch routed to it since (the stats come once per period)."""
        reported = frozenset((replica.routing_stats or {}).get("loras_loaded") or ())
        return reported | self._routed_loras.get(replica.replica_id, frozenset())

    def replica_views(self) -> list[ReplicaView]:
        """The replicas the Router may send batches to; a broken one is never free."""
        busy = set(self._inflight.values())
        live = {r.replica_id.unique_id for r in self.curr_replicas.values()}
        self._excluded &= live  # a replaced replica leaves the set, and its exclusion with it
        return [ReplicaView(r.replica_id.unique_id, self.last_signature_of(r),
                            r.replica_id in busy or self._is_broken(r), self.loaded_loras_of(r))
                for r in self.curr_replicas.values()]

    def exclude_replica_of(self, batch_id: str) -> str | None:
        """Stop choosing the replica ``batch_id`` was routed to (it refused it as broken);
        returns its id, or None when the batch's route is not known."""
        replica_id = self._batch_replica.get(batch_id)
        if replica_id is None:
            return None
        self._excluded.add(replica_id.unique_id)
        return replica_id.unique_id

    def _is_broken(self, replica: RunningReplica) -> bool:
        return replica.replica_id.unique_id in self._excluded or bool((replica.routing_stats or {}).get("broken"))

    def replica_stats(self) -> dict[str, dict]:
        """Per replica id: its ``state`` (last signature), ``reported`` (whether its routing stats
        have come yet: a replica just started has no counters for a moment; helper-67's client
        hit a KeyError), then those stats."""
        return {r.replica_id.unique_id: {"state": self.last_signature_of(r), "reported": bool(r.routing_stats),
                                         **(r.routing_stats or {})}
                for r in self.curr_replicas.values()}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        batch = _batch_of(pending_request)
        if batch is None:  # control calls (facts, stats): any replica
            return [candidate_replicas]
        signature = batch.signature.digest
        healthy = [r for r in candidate_replicas if not self._is_broken(r)]
        candidate_replicas = healthy or candidate_replicas  # with none left, Serve's own checks decide
        candidate_replicas = taking_adapters(candidate_replicas, batch)
        preferred = [r for r in candidate_replicas if r.replica_id.unique_id == batch.preferred_replica]
        matching = [r for r in candidate_replicas if self.last_signature_of(r) == signature and r not in preferred]
        others = [r for r in candidate_replicas if self.last_signature_of(r) != signature and r not in preferred]
        adapters = {spec.name for spec in batch.requests[0].lora}
        others.sort(key=lambda r: -len(adapters & self.loaded_loras_of(r)))  # adapter affinity
        return [ranked for ranked in (preferred, matching, others) if ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        batch = _batch_of(pending_request)
        if batch is not None:
            self._routed_state[replica_id] = batch.signature.digest
            self._routed_loras[replica_id] = frozenset(spec.name for spec in batch.requests[0].lora)
            self._inflight[batch.batch_id] = replica_id
            self._requests[pending_request.metadata.internal_request_id] = batch.batch_id
            self._batch_replica[batch.batch_id] = replica_id
            while len(self._batch_replica) > ROUTES_KEPT:  # the oldest routes go first
                del self._batch_replica[next(iter(self._batch_replica))]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        batch_id = self._requests.pop(internal_request_id, None)
        if batch_id is not None and self._inflight.get(batch_id) == replica_id:
            del self._inflight[batch_id]

    def batch_done(self, batch_id: str) -> None:
        """The Router's word that batch ``batch_id`` has ended (answered, failed or its stream
        cancelled): its replica is free. Serve does not always report a cancelled streaming
        call as completed, and a replica counted busy forever would never get work again."""
        self._inflight.pop(batch_id, None)
        for key in [k for k, b in self._requests.items() if b == batch_id]:
            del self._requests[key]

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._routed_state.pop(replica_id, None)
        self._routed_loras.pop(replica_id, None)
        for key in [k for k, v in self._inflight.items() if v == replica_id]:
            del self._inflight[key]
