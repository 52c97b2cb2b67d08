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
   before queues of batch work, the oldest urgent request first; then the oldest head.
   Priority is not part of the signature: a batch is cut urgent requests first.
2. Without affinity: the first ready queue goes to any free replica.
3. With affinity, ready queues are considered in that order:
   - ``starvation``: a head older than ``max_affinity_wait_ms`` goes to any free replica;
   - ``hit``: a free replica's state already equals the queue's signature;
   - ``miss``: no replica (free or busy) holds that signature, so a free one must switch;
     only a *spare* replica switches (no queued request wants its current state), and
     it switches for the unheld queue with the most images.
   - ``loaded`` (queues whose signature applies LoRA adapters): no free replica holds the
     signature, but one has all of its adapters loaded and is not another ready queue's hit;
     it switches at once (activating
     adapters from its LRU is cheap, loading one from disk is not). A queue whose adapters
     are loaded only on busy replicas waits for one of them like a held signature (at most
     ``max_affinity_wait_ms``): it is not "unheld" for ``miss``.
   Whenever a replica must switch (``miss``, ``starvation``), the one that already has the
   most of the queue's LoRA adapters loaded is chosen.
   A ready queue whose signature is held only by busy replicas waits for one of them
   (at most ``max_affinity_wait_ms``), so state changes happen only when they must.
   Queues of batch work are considered only when no urgent queue can go, and a free
   replica that batch work would take switches instead for an urgent queue no replica holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.modes import Priority, StrEnum

# A deployment idle this long (or max_wait_ms, if shorter) before a request came is not about
# to receive that request's company: clients answered by the last batch resend within a round
# trip (milliseconds), well inside it.
IDLE_GAP_S = 0.1


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
                 affinity: bool = True, idle_s: float | None = None) -> Decision | None:
    """The queue to dispatch now and why, or None (no free replica, nothing ready, or every
    ready queue is waiting for its busy matching replica). ``idle_s``: seconds since the
    last batch in flight ended (None: a batch is in flight)."""
    free = [r for r in replicas if not r.busy]
    if not free:
        return None
    ready = sorted((q for q in queues if q.images and is_ready(
        q, max_batch_size=max_batch_size, max_wait_s=max_wait_s, max_batch_cost=max_batch_cost, idle_s=idle_s)),
        key=serving_order)
    if not ready:
        return None
    if not affinity:
        return Decision(ready[0].signature, RoutingDecision.FIFO, free[0].replica_id)
    wanted = {q.signature for q in queues if q.images}
    held = {r.last_signature for r in replicas}
    # Replicas that may switch without abandoning queued work in their own state.
    spare = sorted((r for r in free if r.last_signature not in wanted), key=lambda r: r.last_signature is not None)
    urgent = [q for q in ready if q.urgent_age_s is not None]
    decision = _affinity_choice(urgent, replicas, spare, held, max_affinity_wait_s)
    if decision is not None:
        return decision
    decision = _affinity_choice([q for q in ready if q.urgent_age_s is None], replicas, spare, held,
                                max_affinity_wait_s)
    unheld_urgent = [q for q in urgent if q.signature not in held]
    if decision is not None and unheld_urgent:  # the free replica switches for urgent work, not batch work
        return Decision(unheld_urgent[0].signature, RoutingDecision.MISS, decision.replica_id)
    return decision


def _affinity_choice(ready: list[QueueView], replicas: list[ReplicaView], spare: list[ReplicaView], held: set,
                     max_affinity_wait_s: float) -> Decision | None:
    """Rule 3 over ``ready`` (in serving order)."""
    free = [r for r in replicas if not r.busy]
    ready_signatures = {q.signature for q in ready}
    for q in ready:
        match = next((r for r in free if r.last_signature == q.signature), None)
        if match is not None:
            return Decision(q.signature, RoutingDecision.HIT, match.replica_id)
        # a replica another ready queue would hit stays that queue's
        warm = next((r for r in free if holds_adapters(r, q) and r.last_signature not in ready_signatures), None)
        if warm is not None:
            return Decision(q.signature, RoutingDecision.LOADED, warm.replica_id)
        if q.head_age_s >= max_affinity_wait_s:
            target = by_adapters(spare or free, q)[0].replica_id
            reason = RoutingDecision.STARVATION if q.signature in held else RoutingDecision.MISS
            return Decision(q.signature, reason, target)
    unheld = [q for q in ready if q.signature not in held and not any(holds_adapters(r, q) for r in replicas)]
    if spare and unheld:  # switch once, for the queue that fills the biggest batch
        q = max(unheld, key=lambda q: (q.images, q.head_age_s))
        return Decision(q.signature, RoutingDecision.MISS, by_adapters(spare, q)[0].replica_id)
    return None


def next_wakeup_s(queues: list[QueueView], *, max_wait_s: float, max_affinity_wait_s: float) -> float | None:
    """Seconds until some queue becomes ready or starving (None when all queues are empty)."""
    waits = []
    for q in queues:
        if not q.images:
            continue
        for limit in (max_wait_s, max_affinity_wait_s):
            if q.head_age_s < limit:
                waits.append(limit - q.head_age_s)
    return min(waits) if waits else None
