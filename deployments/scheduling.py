"""The router's decision, as a pure function: which queue to cut into a batch now.

Plain values in, plain values out, no Ray and no tensors, so the policy reads (and is
tested) as a table. The router owns the queues and calls this whenever something changes.

Policy (late binding; a batch is formed only when a replica can take it):

1. A queue is *ready* when it holds ``max_batch_size`` images (or ``max_batch_cost``), or
   its head has waited ``max_wait_ms``, or its head arrived at an idle deployment (no batch
   in flight for at least ``min(max_wait_ms, IDLE_GAP_S)`` before it came): a lone request
   never waits for company that is not coming, while requests that follow a batch closely
   (closed-loop clients answered a moment ago, bursts) still gather into full batches.
   Queues are considered *urgent work first*: a queue holding an ``interactive`` request, or
   a ``batch`` one that waited past ``max_batch_priority_wait_ms`` (:func:`is_urgent`), comes
   before queues of batch work, the oldest urgent request first; then the oldest head. Batch
   work never takes a free replica that an urgent queue still gathering company (not ready
   yet) would take: one free replica per such queue is held for it, at most ``max_wait_ms``,
   where batch work would hold it for a whole batch. Priority is not part of the signature:
   a batch is cut urgent requests first.
2. Without affinity: the first ready queue goes to any free replica.
3. With affinity, the choice weighs waiting against state changes, a state change counting
   as ``switch_cost_s`` of waiting (``affinity_switch_cost_ms``):
   - ``starvation``: a head older than ``max_affinity_wait_ms`` goes first, to its own
     replica if that one is free, else to any free replica (the hard bound);
   - otherwise every (ready queue, free replica) pair is valued by how long the queue's head
     has waited, plus ``switch_cost_s`` when the replica need not change state: a ``hit``
     (its state is the queue's signature) or ``loaded`` (a LoRA queue whose adapters the
     replica has loaded, activating them is cheap; the replica's own state has no ready
     queue), minus ``switch_cost_s`` when the queue's state is held by a busy replica (or
     its adapters are loaded on one): switching for it would take that replica's next hit.
     A ``miss`` (a switch) is allowed only if its value exceeds what the replica's own queue
     is worth to it (its head's wait + ``switch_cost_s``, ready or not: a replica leaves
     queued work in its state only for a queue waiting longer by ``switch_cost_s``), and a
     queue held by a busy replica waits for it while its value is not positive. The pair of
     highest value goes; ties prefer a hit, then a spare replica (no queue wants its state),
     the one with the most of the queue's adapters loaded, a fresh one, the serving order.
   A replica's own queue counts for one free replica in that state (others are spare), and
   for urgent work only if it holds urgent work too.
   So a free replica keeps serving its own state while the other queues are younger than
   its own queue by ``switch_cost_s`` and switches for the longest-waiting queue otherwise:
   oldest-first with a price on switching. (It replaced waiting for the matching replica up to
   ``max_affinity_wait_ms``, whose idle replicas cost tail latency: on ``bench/batching.py``'s
   mixed workload, 0.47 x the default router's state changes at 1.27-1.72 x its p99 latency,
   or 0.72 x at 0.86 x; this policy measured 0.52-0.62 x at 1.05-1.19 x (250 ms) and
   0.63-0.70 x at 0.93-0.94 x (100 ms) on the same 2-core machine, and ``bench/affinity_sim.py``
   shows the online policies tried sharing that trade-off.)
   Queues of batch work are considered only when no urgent queue can go, and a free
   replica that batch work would take switches instead for an urgent queue no replica holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.modes import Priority, StrEnum

# A deployment idle this long (or max_wait_ms, if shorter) before a request came is not about
# to receive that request's company: clients answered by the last batch resend within a round
# trip (milliseconds), well inside it.
IDLE_GAP_S = 0.1
# A state change priced as this much waiting (BatchingConfig.affinity_switch_cost_ms).
DEFAULT_SWITCH_COST_S = 0.25


class RoutingDecision(StrEnum):
    """Why a queue was dispatched to a replica (see the module docstring)."""

    FIFO = "fifo"
    HIT = "hit"
    MISS = "miss"
    LOADED = "loaded"
    STARVATION = "starvation"


@dataclass(frozen=True)
class QueueView:
    signature: str      # BatchSignature digest
    head_age_s: float   # how long the oldest request has waited
    images: int         # sum of n over the queue
    cost: float         # sum of pixels x frames x n over the queue
    urgent_age_s: float | None = None  # how long its oldest urgent request has waited (None: none)
    loras: frozenset[str] = frozenset()  # names of the LoRA adapters its signature applies


@dataclass(frozen=True)
class ReplicaView:
    replica_id: str
    last_signature: str | None  # digest of the signature it last ran: its acceleration state (None: fresh)
    busy: bool
    loaded_loras: frozenset[str] = frozenset()  # LoRA adapters it holds loaded (its LRU)


@dataclass(frozen=True)
class Decision:
    signature: str
    reason: RoutingDecision
    replica_id: str     # the free replica the batch is meant for


def is_urgent(priority: Priority, waited_s: float, max_batch_priority_wait_s: float) -> bool:
    """Served before batch work: ``interactive``, or ``batch`` past its starvation bound."""
    return priority != Priority.BATCH or waited_s >= max_batch_priority_wait_s


def serving_order(q: QueueView) -> tuple:
    """Sort key of rule 1: queues with urgent work first (oldest urgent request first), then
    the oldest head."""
    urgent = q.urgent_age_s is not None
    return (not urgent, -(q.urgent_age_s if urgent else 0.0), -q.head_age_s)


def holds_adapters(replica: ReplicaView, q: QueueView) -> bool:
    """Whether ``replica`` has every LoRA adapter of ``q``'s signature loaded (False without any)."""
    return bool(q.loras) and q.loras <= replica.loaded_loras


def by_adapters(replicas: list[ReplicaView], q: QueueView) -> list[ReplicaView]:
    """``replicas`` with those holding more of ``q``'s LoRA adapters loaded first (stable)."""
    if not q.loras:
        return replicas
    return sorted(replicas, key=lambda r: -len(q.loras & r.loaded_loras))


def is_ready(q: QueueView, *, max_batch_size: int, max_wait_s: float, max_batch_cost: float | None,
             idle_s: float | None = None) -> bool:
    """Rule 1 of the module docstring. ``idle_s``: seconds since the deployment last had a
    batch in flight (None: one is in flight now)."""
    full = q.images >= max_batch_size or (max_batch_cost is not None and q.cost >= max_batch_cost)
    arrived_idle = idle_s is not None and idle_s - q.head_age_s >= min(max_wait_s, IDLE_GAP_S)
    return full or q.head_age_s >= max_wait_s or arrived_idle


def choose_queue(queues: list[QueueView], replicas: list[ReplicaView], *, max_batch_size: int,
                 max_wait_s: float, max_affinity_wait_s: float, max_batch_cost: float | None = None,
                 affinity: bool = True, idle_s: float | None = None,
                 switch_cost_s: float = DEFAULT_SWITCH_COST_S) -> Decision | None:
    """The queue to dispatch now and why, or None (no free replica, nothing ready, or every
    ready queue is better off waiting: for its busy matching replica, or because the free
    replicas' own queues are worth more). ``idle_s``: seconds since the last batch in flight
    ended (None: a batch is in flight). ``switch_cost_s``: a state change, in seconds of
    waiting (rule 3)."""
    free = [r for r in replicas if not r.busy]
    if not free:
        return None
    ready = sorted((q for q in queues if q.images and is_ready(
        q, max_batch_size=max_batch_size, max_wait_s=max_wait_s, max_batch_cost=max_batch_cost, idle_s=idle_s)),
        key=serving_order)
    if not ready:
        return None
    # free replicas held for urgent queues still gathering company (not ready yet): batch work
    # waits for them at most max_wait_ms instead of taking them for a whole batch
    reserved = _reserved_for_gathering(queues, ready, free)
    batch_replicas = [replace(r, busy=True) if r.replica_id in reserved else r for r in replicas]
    if not affinity:  # batch work only on a free replica no urgent queue gathers for
        takers = free if ready[0].urgent_age_s is not None else [r for r in batch_replicas if not r.busy]
        return Decision(ready[0].signature, RoutingDecision.FIFO, takers[0].replica_id) if takers else None
    waiting = {q.signature: q.head_age_s for q in queues if q.images}  # every queued state, ready or not
    held = {r.last_signature for r in replicas}
    urgent = [q for q in ready if q.urgent_age_s is not None]
    # for urgent work a replica's own queue counts only if it holds urgent work too
    urgent_waiting = {q.signature: q.head_age_s for q in queues if q.images and q.urgent_age_s is not None}
    decision = _affinity_choice(urgent, replicas, urgent_waiting, held, max_affinity_wait_s, switch_cost_s)
    if decision is not None:
        return decision
    decision = _affinity_choice([q for q in ready if q.urgent_age_s is None], batch_replicas, waiting, held,
                                max_affinity_wait_s, switch_cost_s)
    unheld_urgent = [q for q in urgent if q.signature not in held]
    if decision is not None and unheld_urgent:  # the free replica switches for urgent work, not batch work
        return Decision(unheld_urgent[0].signature, RoutingDecision.MISS, decision.replica_id)
    return decision


def _reserved_for_gathering(queues: list[QueueView], ready: list[QueueView], free: list[ReplicaView]) -> set[str]:
    """Ids of the free replicas held for urgent queues that are not ready yet (gathering company
    for up to ``max_wait_ms``), one per queue in serving order: the one in its state, else one
    whose state no ready queue of batch work has, else the first left."""
    ready_signatures = {q.signature for q in ready}
    batch_states = {q.signature for q in ready if q.urgent_age_s is None}
    gathering = sorted((q for q in queues if q.images and q.urgent_age_s is not None
                        and q.signature not in ready_signatures), key=serving_order)
    left, reserved = list(free), set()
    for q in gathering:
        if not left:
            break
        pick = (next((r for r in left if r.last_signature == q.signature), None)
                or next((r for r in left if r.last_signature not in batch_states), None) or left[0])
        reserved.add(pick.replica_id)
        left.remove(pick)
    return reserved


def _affinity_choice(ready: list[QueueView], replicas: list[ReplicaView], waiting: dict[str, float], held: set,
                     max_affinity_wait_s: float, switch_cost_s: float) -> Decision | None:
    """Rule 3 over ``ready`` (in serving order). ``waiting``: head age of the queues a free
    replica in their state waits for (one replica per state; the others are spare)."""
    free = [r for r in replicas if not r.busy]
    if not free:  # every free replica is held for urgent work gathering company
        return None
    owners: dict[str, str] = {}  # a queued state -> the one free replica that waits for it (others are spare)
    for r in free:
        if r.last_signature in waiting:
            owners.setdefault(r.last_signature, r.replica_id)
    spare = [r for r in free if owners.get(r.last_signature) != r.replica_id]
    for q in ready:  # the hard bound first
        if q.head_age_s >= max_affinity_wait_s:
            match = next((r for r in free if r.last_signature == q.signature), None)
            if match is not None:
                return Decision(q.signature, RoutingDecision.HIT, match.replica_id)
            target = _switch_order(spare or free, q)[0].replica_id
            reason = RoutingDecision.STARVATION if q.signature in held else RoutingDecision.MISS
            return Decision(q.signature, reason, target)
    ready_signatures = {q.signature for q in ready}
    busy = [r for r in replicas if r.busy]
    best, best_key = None, None
    for order, q in enumerate(ready):
        kept_busy = any(r.last_signature == q.signature or holds_adapters(r, q) for r in busy)
        for r in free:
            if r.last_signature == q.signature:
                value, reason = q.head_age_s + switch_cost_s, RoutingDecision.HIT
            elif holds_adapters(r, q) and r.last_signature not in ready_signatures:
                value, reason = q.head_age_s + switch_cost_s, RoutingDecision.LOADED
            else:
                value, reason = q.head_age_s - (switch_cost_s if kept_busy else 0.0), RoutingDecision.MISS
                own = None if r in spare else waiting[r.last_signature]
                if (kept_busy and value <= 0) or (own is not None and value <= own + switch_cost_s):
                    continue  # wait: for the busy replica holding it, or the replica's own queue is worth more
            key = (value, reason != RoutingDecision.MISS, r in spare, len(q.loras & r.loaded_loras),
                   r.last_signature is None, -order)
            if best_key is None or key > best_key:
                best, best_key = Decision(q.signature, reason, r.replica_id), key
    return best


def _switch_order(replicas: list[ReplicaView], q: QueueView) -> list[ReplicaView]:
    """Replicas to switch for ``q``, best first: by ``by_adapters``, then fresh ones."""
    return by_adapters(sorted(replicas, key=lambda r: r.last_signature is not None), q)


def next_wakeup_s(queues: list[QueueView], *, max_wait_s: float, max_affinity_wait_s: float,
                  switch_cost_s: float = DEFAULT_SWITCH_COST_S) -> float | None:
    """Seconds until some queue becomes ready, worth a switch away from a busy replica's
    state, or starving (None when all queues are empty)."""
    waits = []
    for q in queues:
        if not q.images:
            continue
        for limit in (max_wait_s, switch_cost_s, max_affinity_wait_s):
            if q.head_age_s < limit:
                waits.append(limit - q.head_age_s)
    return min(waits) if waits else None
