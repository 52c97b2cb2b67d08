"""Affinity routing in simulation: how far below the default router's state changes a router
can go on ``bench/batching.py``'s mixed workload at no more than 1.10x its p99 latency, with
the router's own policy, with an online planner, and with an offline search.

The workload as a discrete-event model: 100 requests whose signatures are
``num_inference_steps`` 2-5 (``random.Random(0)``, as the bench draws them), sent in order by 8
closed-loop clients (a client sends its next request when its answer is back, ``HOP_S`` each
way) to 2 replicas, ``max_batch_size`` 4, 3 rounds. A batch of ``b`` images at ``k`` steps
holds its replica ``F + k·(A + C·b) + D·b`` seconds, ±``NOISE`` uniform. The constants are a
least-squares fit to 115 batches of the default router on the bench's workload on the 2-core
development machine (denoise + decode ms by steps and batch size, plus the replica's other work
per batch, 51 ms median; ~40 ms median for the HTTP round trip): with them the model's default
router makes ~47 state changes per 100 requests at a p99 of 0.75 s, as measured (47.7, 0.76 s).

Policies, each printed as (state changes / default's, p99 latency / default's):

- ``default``: ``deployments.scheduling.choose_queue`` with ``affinity=False`` (the real function).
- ``affinity``: the same function with affinity, at several ``affinity_switch_cost_ms``.
- ``lookahead``: an online rollout policy (Bertsekas, *Rollout Algorithms for Discrete
  Optimization*, 2013): at every decision it simulates each possible action (each queue to
  each free replica, or waiting) ``--horizon-s`` ahead over ``--futures`` sampled futures (new
  requests' signatures drawn uniformly: a router does not know them), continuing with
  ``affinity`` at 100 ms, and takes the action of least ``changes + λ · Σ s over --target-s``
  of the latencies and waits; it knows more than a router would (:func:`lookahead_policy`).
  ``lookahead, true future``: the same, its rollouts seeing the signatures that will really
  come (no router can).
- ``hindsight`` (with ``--hindsight-seeds N``; slow): an online search of whole schedules
  over sampled futures (:func:`hindsight_policy`): per action and sampled future, a beam
  search ``--hindsight-horizon-s`` ahead instead of one base policy's continuation.
- ``tuned by policy search``: random search (``--search-candidates``) over a five-parameter
  generalisation of the router's rule (:func:`tuned_policy`: a bonus per batched image, a
  separate price on taking a busy replica's state, a margin on misses, an idle hold), the
  candidate of fewest changes at p99 / default <= ``--search-bound`` on train seeds,
  re-measured on held-out seeds (:func:`policy_search`).
- ``joining``: a mechanism, not a policy: :class:`JoinSim` lets a running batch take requests
  of its own signature at every step boundary (step-level "continuous batching", which
  ditserve does not have), with the router's rule at its default switch cost, and tuned by the
  same policy search over :func:`joining_policy` (switch cost and an idle hold). It asks
  whether giving the replica that power would move the trade-off enough to be worth building.
- ``clairvoyant``: an offline beam search (``--beam`` schedules kept per decision) over the same
  actions, knowing every signature in advance and every duration (noise-free), with every
  latency at most 1.10x the noise-free default's p99 (one round: its p99 is its maximum). A
  search, not a proof: its figure is one schedule that exists, not the least possible.

Each ratio is against the default router's run with the same noise seed; the range over the
seeds follows it (p99 of 300 latencies is their 3rd largest: a few requests move it).

    .venv/bin/python bench/affinity_sim.py [--seeds 16] [--lookahead-seeds 3] [--beam 300] [--hindsight-seeds 0]
        [--search-candidates 500] [--join-search-candidates 300]

No Ray, no model, one core: about three minutes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments import scheduling  # noqa: E402

HOP_S = 0.020
CLIENTS, REPLICAS, MAX_BATCH, MAX_WAIT_S = 8, 2, 4, 0.010
SIGNATURES = (2, 3, 4, 5)  # num_inference_steps
F, A, C, D = 0.088, 0.0175, 0.0063, 0.0133  # s: per batch, per step, per step and image, per image
NOISE = 0.40  # uniform relative noise of a batch's duration
# Step-level joining (JoinSim), per request: a join encodes its prompt alone (5.8 ms measured on
# tiny-flux with 1 thread) and makes its latents (0.2 ms), plus the Router's message; a row that
# finishes before its batch sends its output on its own (the replica -> Router stream item, 3.7 ms
# measured on the HTTP path).
JOIN_S, ANSWER_S = 0.008, 0.004


def batch_s(steps: int, images: int) -> float:
    """Modelled duration (s) of a batch of ``images`` at ``steps`` steps, noise-free."""
    return F + steps * (A + C * images) + D * images


def workload(requests: int = 100) -> list[int]:
    rng = random.Random(0)
    return [rng.choice(SIGNATURES) for _ in range(requests)]


@dataclass
class Replica:
    state: int | None = None         # the signature of its last batch (None: fresh)
    busy_until: float | None = None  # s (None: free)
    members: tuple = ()              # send times of the requests in its running batch
    rows: tuple = ()                 # JoinSim: (send time, steps done) of each running request
    factor: float = 1.0              # JoinSim: its running batch's noise factor


class Sim:
    """One round's state: queues (signature -> [(arrived, sent)]), replicas, requests in
    transit ((arrives, signature, sent)), counters. Copyable for lookahead and search."""

    def __init__(self, sequence: list[int], t0: float = 0.0, states=(None,) * REPLICAS):
        self.sequence, self.t, self.sent = sequence, t0, CLIENTS
        self.queues: dict[int, list] = {}
        self.replicas = [Replica(state) for state in states]
        self.transit = sorted((t0 + HOP_S, sequence[i], t0) for i in range(CLIENTS))
        self.done, self.changes, self.latencies, self.idle_since = 0, 0, [], t0

    def copy(self) -> "Sim":
        c = Sim.__new__(Sim)
        c.sequence, c.t, c.sent, c.done, c.changes, c.idle_since = (
            self.sequence, self.t, self.sent, self.done, self.changes, self.idle_since)
        c.queues = {k: list(v) for k, v in self.queues.items()}
        c.replicas = [replace(r) for r in self.replicas]
        c.transit, c.latencies = list(self.transit), list(self.latencies)
        return c

    def finished(self) -> bool:
        return self.done == len(self.sequence)

    def next_event(self) -> float | None:
        times = [r.busy_until for r in self.replicas if r.busy_until is not None] + [a for a, _, _ in self.transit[:1]]
        return min(times, default=None)

    def advance(self, t: float, next_signature) -> None:
        """Move to time ``t``: arrivals join their queues, finished batches answer (their
        clients send their next requests, of ``next_signature(self)``)."""
        self.t = t
        while self.transit and self.transit[0][0] <= t + 1e-12:
            arrived, signature, sent = self.transit.pop(0)
            self.queues.setdefault(signature, []).append((arrived, sent))
        for r in self.replicas:
            if r.busy_until is not None and r.busy_until <= t + 1e-12:
                for sent in r.members:
                    self._answer(t, sent, next_signature)
                self.transit.sort()
                r.busy_until, r.members = None, ()
        if self.idle_since is None and all(r.busy_until is None for r in self.replicas):
            self.idle_since = t

    def _answer(self, t: float, sent: float, next_signature) -> None:
        """Answer at ``t`` the request sent at ``sent``; its client sends its next one (unsorted
        into ``transit``: the caller sorts)."""
        self.latencies.append(t + HOP_S - sent)
        self.done += 1
        if self.sent < len(self.sequence):
            self.transit.append((t + 2 * HOP_S, next_signature(self), t + HOP_S))
            self.sent += 1

    def dispatch(self, signature: int, replica: int, duration_s: float) -> None:
        queue = self.queues[signature]
        cut, self.queues[signature] = queue[:MAX_BATCH], queue[MAX_BATCH:]
        r = self.replicas[replica]
        self.changes += r.state is not None and r.state != signature
        r.state, r.busy_until, r.members = signature, self.t + duration_s, tuple(sent for _, sent in cut)
        self.idle_since = None

    def next_batch_s(self, signature: int) -> float:
        """Noise-free duration (s) of the batch ``signature``'s queue would make now."""
        return batch_s(signature, min(MAX_BATCH, len(self.queues[signature])))

    def actions(self) -> list:
        """Every distinct dispatch (signature, free replica) now, and None (wait for the next event)."""
        free = [i for i, r in enumerate(self.replicas) if r.busy_until is None]
        out = [None]
        for signature, queue in self.queues.items():
            seen = set()
            for i in free:
                kind = self.replicas[i].state
                if queue and kind not in seen:
                    seen.add(kind)
                    out.append((signature, i))
        if len(out) > 1 and self.next_event() is None:
            out.remove(None)  # nothing would ever happen
        return out

    def views(self):
        queues = [scheduling.QueueView(str(s), self.t - q[0][0], len(q), float(len(q)))
                  for s, q in self.queues.items() if q]
        replicas = [scheduling.ReplicaView(str(i), None if r.state is None else str(r.state), r.busy_until is not None)
                    for i, r in enumerate(self.replicas)]
        return queues, replicas


class JoinSim(Sim):
    """:class:`Sim` with step-level joining, a mechanism ditserve does not have ("continuous
    batching" within one signature), modelled to see whether it would move the trade-off: at
    every step boundary a running batch takes requests queued for its own signature (up to
    ``MAX_BATCH`` rows, ``JOIN_S`` each), each row runs its own ``k`` steps and is decoded and
    answered when they are done (``D``, and ``ANSWER_S`` when others still run), and the replica
    is free when its last row is. A step costs ``A + C·rows`` (the first ``F`` more) times the
    batch's noise factor, drawn once per dispatch as for a whole batch in :class:`Sim` (without
    joins, ``joins = False``, every batch takes as long as there)."""

    joins = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.answers: list[tuple[float, float]] = []  # (answered at, sent) of rows done, decoding

    def copy(self) -> "JoinSim":
        c = super().copy()
        c.__class__, c.answers = type(self), list(self.answers)
        return c

    def next_event(self) -> float | None:
        times = [t for t in (super().next_event(), self.answers[0][0] if self.answers else None) if t is not None]
        return min(times, default=None)

    def dispatch(self, signature: int, replica: int, duration_s: float) -> None:
        size = min(MAX_BATCH, len(self.queues[signature]))
        super().dispatch(signature, replica, duration_s)
        r = self.replicas[replica]
        r.factor = duration_s / batch_s(signature, size)
        r.rows, r.members = tuple((sent, 0) for sent in r.members), ()  # answered here, not by Sim.advance
        r.busy_until = self.t + (F + A + C * size) * r.factor

    def advance(self, t: float, next_signature) -> None:
        ended = [r for r in self.replicas if r.busy_until is not None and r.busy_until <= t + 1e-12]
        super().advance(t, next_signature)  # arrivals; frees the ended replicas
        while self.answers and self.answers[0][0] <= t + 1e-12:
            _, sent = self.answers.pop(0)
            self._answer(t, sent, next_signature)
        self.transit.sort()
        for r in ended:
            if not r.rows:  # its last rows' decode has ended
                continue
            rows = [(sent, done + 1) for sent, done in r.rows]
            finished = [sent for sent, done in rows if done >= r.state]
            rows = [(sent, done) for sent, done in rows if done < r.state]
            tail = D * len(finished) * r.factor + (ANSWER_S * len(finished) if rows else 0.0)
            self.answers = sorted(self.answers + [(t + tail, sent) for sent in finished])
            queue = self.queues.get(r.state, [])
            joining = queue[:MAX_BATCH - len(rows)] if rows and self.joins else []
            self.queues[r.state] = queue[len(joining):]
            rows += [(sent, 0) for _, sent in joining]
            r.rows = tuple(rows)
            r.busy_until = t + tail + ((A + C * len(rows) + JOIN_S * len(joining)) * r.factor if rows else 0.0)
            if r.busy_until <= t:
                r.busy_until = None
            else:
                self.idle_since = None
        if self.idle_since is None and all(r.busy_until is None for r in self.replicas):
            self.idle_since = t


def joining_policy(switch_cost_s: float, hold_s: float = 0.0, hold_images: float = 0.0):
    """For :class:`JoinSim`: ``choose_queue`` with affinity, and a free replica whose own queue
    is empty does not switch for a queue younger than ``hold_s`` holding fewer than
    ``hold_images`` images (an idle hold: joining returns the latency it costs)."""
    base = choose_queue_policy(True, switch_cost_s)

    def decide(sim: Sim):
        action, wake = base(sim)
        if action is None or hold_s <= 0:
            return action, wake
        signature, replica = action
        r, queue = sim.replicas[replica], sim.queues[signature]
        if r.state is not None and r.state != signature and not sim.queues.get(r.state) \
                and len(queue) < hold_images and sim.t - queue[0][0] < hold_s:
            until = queue[0][0] + hold_s + 1e-6
            return None, until if wake is None else min(wake, until)
        return action, wake
    return decide


def choose_queue_policy(affinity: bool, switch_cost_s: float = scheduling.DEFAULT_SWITCH_COST_S):
    """``deployments.scheduling.choose_queue`` as a policy: (action, next wake-up time or None)."""
    def decide(sim: Sim):
        queues, replicas = sim.views()
        if not queues:
            return None, None
        idle_s = sim.t - sim.idle_since if sim.idle_since is not None else None
        d = scheduling.choose_queue(queues, replicas, max_batch_size=MAX_BATCH, max_wait_s=MAX_WAIT_S,
                                    max_affinity_wait_s=2.0, affinity=affinity, idle_s=idle_s,
                                    switch_cost_s=switch_cost_s)
        wake = scheduling.next_wakeup_s(queues, max_wait_s=MAX_WAIT_S, max_affinity_wait_s=2.0,
                                        switch_cost_s=switch_cost_s)
        return (None if d is None else (int(d.signature), int(d.replica_id))), (
            None if wake is None else sim.t + wake + 1e-6)
    return decide


def run(sim: Sim, decide, duration, next_signature, until: float | None = None) -> None:
    """Drive ``sim`` with ``decide`` until the round ends (or time ``until``)."""
    while not sim.finished():
        while True:
            action, wake = decide(sim)
            if action is None:
                break
            sim.dispatch(*action, duration(*action, sim))
        t = sim.next_event()
        if wake is not None and (t is None or wake < t):
            t = wake
        if t is None:
            raise RuntimeError("stuck: queued work and no event")
        if until is not None and t > until:
            sim.t = until
            return
        sim.advance(t, next_signature)


def lookahead_policy(target_s: float, weight: float, horizon_s: float, futures: int, seed: int,
                     true_future: bool = False):
    """The rollout policy of the module docstring. What it sees is more than a router could:
    the running batches' real end times, requests in transit (``HOP_S`` before they arrive),
    noise-free durations for the batches it simulates; with ``true_future`` the signatures to
    come. Waiting is simulated up to the next event only (it may re-decide sooner)."""
    rng = random.Random(seed)
    base = choose_queue_policy(True, 0.1)

    def exact(signature, replica, sim):
        return sim.next_batch_s(signature)

    def decide(sim: Sim):
        actions = sim.actions()
        _, wake = base(sim)
        if len(actions) == 1:
            return actions[0], wake
        draws = [rng.random() for _ in range(1 if true_future else futures)]
        best, best_score = None, None
        for action in actions:
            score = 0.0
            for draw in draws:
                future = random.Random(draw)
                coming = (lambda m: m.sequence[m.sent]) if true_future else (lambda _: future.choice(SIGNATURES))
                m = sim.copy()
                m.latencies = []
                before = m.changes
                if action is None:
                    m.advance(m.next_event(), coming)
                else:
                    m.dispatch(*action, exact(*action, m))
                run(m, base, exact, coming, until=sim.t + horizon_s)
                waiting = [m.t - sent for q in m.queues.values() for _, sent in q]
                over = sum(max(0.0, x - target_s) for x in m.latencies + waiting)
                score += m.changes - before + weight * over
            if best_score is None or score < best_score - 1e-9:
                best, best_score = action, score
        return best, wake
    return decide


def simulate(decide, seed: int, rounds: int = 3, noise: float = NOISE, model: type[Sim] = Sim) -> tuple[float, float]:
    """(state changes per 100 requests, p99 latency s) over ``rounds`` rounds of the workload,
    run by ``model`` (:class:`Sim`, or :class:`JoinSim`)."""
    sequence, rng = workload(), random.Random(seed)
    duration = (lambda s, i, sim: sim.next_batch_s(s) * (1 + rng.uniform(-noise, noise)))
    latencies, changes, t, states = [], 0, 0.0, (None,) * REPLICAS
    for _ in range(rounds):
        sim = model(sequence, t, states)
        run(sim, decide, duration, lambda m: m.sequence[m.sent])
        latencies += sim.latencies
        changes += sim.changes
        t, states = sim.t, tuple(r.state for r in sim.replicas)
    latencies.sort()
    return 100 * changes / (len(sequence) * rounds), latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]


def _successors(node: Sim, coming, stop_s: float | None = None):
    """Every schedule reachable from ``node`` by a sequence of dispatches now and then waiting
    for the next event, as ``(schedule, ended)``: ``ended`` when the round is over or (with
    ``stop_s``) the next event comes after ``stop_s`` (the schedule is then left at ``stop_s``).
    Batches take their noise-free durations."""
    stack = [node]
    while stack:
        m = stack.pop()
        for action in m.actions():
            c = m.copy()
            if action is None:
                t = c.next_event()
                if t is None:
                    continue
                if stop_s is not None and t > stop_s:
                    c.t = stop_s
                    yield c, True
                    continue
                c.advance(t, coming)
                yield c, c.finished()
            else:
                c.dispatch(*action, c.next_batch_s(action[0]))
                stack.append(c)


def _distinct(schedules: list[Sim]) -> list[Sim]:
    """One schedule per (time, answered, changes, replicas, queue lengths)."""
    unique = {}
    for c in schedules:
        key = (round(c.t, 6), c.done, c.changes,
               tuple((r.state, r.busy_until and round(r.busy_until, 6)) for r in c.replicas),
               tuple(sorted((s, len(q)) for s, q in c.queues.items())))
        unique.setdefault(key, c)
    return list(unique.values())


def clairvoyant(bound_s: float, beam: int, rate: float = 0.2, age_weight: float = 2.0,
                age_free_s: float = 0.1) -> Sim | None:
    """Fewest state changes found for one noise-free round with every latency <= ``bound_s``.
    Beam search over :meth:`Sim.actions` at every event; schedules ranked by changes less
    ``rate`` per answered request plus ``age_weight`` x the queued waits over ``age_free_s``
    (weights that found the fewest changes among a few tried)."""
    sequence = workload()
    known = (lambda m: m.sequence[m.sent])

    def doomed(m: Sim) -> bool:
        late = any(x > bound_s + 1e-9 for x in m.latencies[-MAX_BATCH * REPLICAS:])
        return late or any(m.t - sent + batch_s(s, 1) + HOP_S > bound_s + 1e-9
                           for s, q in m.queues.items() for _, sent in q)

    start = Sim(sequence)
    start.advance(start.next_event(), known)
    layer, best = [start], None
    while layer:
        children = []
        for node in layer:
            for c, ended in _successors(node, known):
                if ended:
                    if max(c.latencies) <= bound_s + 1e-9 and (best is None or c.changes < best.changes):
                        best = c
                elif not doomed(c):
                    children.append(c)
        layer = sorted(_distinct(children), key=lambda c: (
            c.changes - rate * c.done + age_weight * sum(max(0.0, c.t - sent - age_free_s)
                                                         for q in c.queues.values() for _, sent in q), c.t))[:beam]
    return best


def hindsight_policy(target_s: float, weight: float, horizon_s: float, beam: int, futures: int, seed: int):
    """Hindsight optimisation (Chong, Givan & Chang, *A Framework for Simulation-based Network
    Control via Hindsight Optimization*, 2000): at every decision, for each possible action and
    each of ``futures`` sampled futures (new requests' signatures drawn uniformly, the same
    futures for every action), a beam search (``beam`` schedules) finds the best continuation
    it can, knowing that future, up to ``horizon_s`` after the decision (the same window for
    every action); the action of least total ``changes + λ · Σ s over target_s`` over the
    futures goes. An online policy (it knows no real future) that searches whole schedules,
    not one base policy's continuation as ``lookahead`` does; it also sees what ``lookahead``
    sees beyond a router."""
    rng = random.Random(seed)
    base = choose_queue_policy(True, 0.1)

    def score(m: Sim) -> float:
        waiting = [m.t - sent for q in m.queues.values() for _, sent in q]
        return m.changes + weight * sum(max(0.0, x - target_s) for x in m.latencies + waiting)

    def best_continuation(m: Sim, coming, stop_s: float) -> float:
        layer, best = [m], float("inf")
        while layer:
            children = []
            for node in layer:
                for c, ended in _successors(node, coming, stop_s):
                    if ended:
                        best = min(best, score(c))
                    else:
                        children.append(c)
            layer = _distinct(sorted(children, key=score))[:beam]  # of equal states, the best scored
        return best

    def sampled_future(draw: float):
        """Signatures of the requests to come, drawn once each (the same for every action)."""
        future, drawn = random.Random(draw), {}

        def coming(m: Sim) -> int:
            if m.sent not in drawn:  # requests are sent in order: the k-th draw is request k's
                drawn[m.sent] = future.choice(SIGNATURES)
            return drawn[m.sent]
        return coming

    def decide(sim: Sim):
        actions = sim.actions()
        _, wake = base(sim)
        if len(actions) == 1:
            return actions[0], wake
        draws = [rng.random() for _ in range(futures)]
        best, best_score = None, None
        for action in [a for a in actions if a is not None] + [None] * (None in actions):  # ties: dispatch
            total = 0.0
            for draw in draws:
                coming = sampled_future(draw)
                m = sim.copy()
                m.latencies = []
                if action is None:
                    m.advance(m.next_event(), coming)
                else:
                    m.dispatch(*action, m.next_batch_s(action[0]))
                total += best_continuation(m, coming, max(sim.t + horizon_s, m.t))  # one window for every action
            if best_score is None or total < best_score - 1e-9:
                best, best_score = action, total
        return best, wake
    return decide


TUNED_RANGES = {  # s: the box the policy search draws each parameter of tuned_policy from
    "switch_cost_s": (0.0, 0.6), "batch_weight_s": (-0.1, 0.3), "busy_cost_s": (-0.2, 0.6),
    "margin_s": (-0.2, 0.3), "hold_s": (0.0, 0.4)}


def tuned_policy(switch_cost_s: float, batch_weight_s: float, busy_cost_s: float, margin_s: float,
                 hold_s: float):
    """A five-parameter generalisation of the router's rule 3, for the policy search (at
    ``batch_weight_s = margin_s = hold_s = 0``, ``busy_cost_s = switch_cost_s`` it makes the
    router's runs on this workload, ``tests/test_affinity_sim.py``, though not every decision
    the same: it takes every free replica in a queued state for that queue's, where the router
    has one owner and the others spare, and sends a starving queue to the first free replica): a (ready queue, free replica) pair is worth the head's wait plus
    ``batch_weight_s`` per image beyond the first it would batch, plus ``switch_cost_s`` on a
    hit, less ``busy_cost_s`` when a busy replica holds the queue's state (and then only while
    positive). A miss must beat the replica's own queue's worth by ``margin_s``; a replica
    whose own queue is empty does not switch for a queue younger than ``hold_s`` that is not
    full. Heads older than ``max_affinity_wait_ms`` (2 s) go first, as in the router."""
    def worth(q: scheduling.QueueView) -> float:
        return q.head_age_s + batch_weight_s * (min(q.images, MAX_BATCH) - 1)

    def decide(sim: Sim):
        queues, replicas = sim.views()
        idle_s = sim.t - sim.idle_since if sim.idle_since is not None else None
        ready = [q for q in queues if scheduling.is_ready(q, max_batch_size=MAX_BATCH, max_wait_s=MAX_WAIT_S,
                                                          max_batch_cost=None, idle_s=idle_s)]
        free = [r for r in replicas if not r.busy]
        by_state = {q.signature: q for q in queues}
        held_busy = {r.last_signature for r in replicas if r.busy}
        waits = [MAX_WAIT_S - q.head_age_s for q in queues if q not in ready]  # till ready
        waits += [hold_s - q.head_age_s for q in ready]  # till past the hold
        waits += [busy_cost_s - worth(q) for q in ready if q.signature in held_busy]  # till worth a switch
        positive = [w for w in waits if w > 1e-9]
        wake = sim.t + min(positive) + 1e-6 if positive else None
        if not free or not ready:
            return None, wake
        oldest = max(ready, key=lambda q: q.head_age_s)
        if oldest.head_age_s >= 2.0:
            r = next((r for r in free if r.last_signature == oldest.signature), free[0])
            return (int(oldest.signature), int(r.replica_id)), wake
        best, best_key = None, None
        for q in ready:
            for r in free:
                if r.last_signature == q.signature:
                    value = worth(q) + switch_cost_s
                else:
                    value = worth(q) - (busy_cost_s if q.signature in held_busy else 0.0)
                    own = by_state.get(r.last_signature)
                    if q.signature in held_busy and value <= 0:
                        continue
                    if own is not None and value <= worth(own) + switch_cost_s + margin_s:
                        continue
                    if own is None and r.last_signature is not None and q.head_age_s < hold_s \
                            and q.images < MAX_BATCH:
                        continue
                key = (value, r.last_signature == q.signature)
                if best_key is None or key > best_key:
                    best, best_key = (int(q.signature), int(r.replica_id)), key
        return best, wake
    return decide


JOIN_RANGES = {  # the box the policy search draws joining_policy's parameters from (s, s, images)
    "switch_cost_s": (0.0, 0.8), "hold_s": (0.0, 0.5), "hold_images": (1.0, 5.0)}


def policy_search(candidates: int, train_seeds: int, test_seeds: int, bound: float, seed: int = 0,
                  make=None, ranges: dict | None = None, model: type[Sim] = Sim):
    """Direct policy search (random search, Bergstra & Bengio, *Random Search for Hyper-Parameter
    Optimization*, JMLR 2012) over the parameters of ``make`` (:func:`tuned_policy`) drawn
    uniformly from ``ranges`` (``TUNED_RANGES``), each run by ``model``: the candidate of fewest
    mean changes / default at a mean p99 / default <= ``bound`` on noise seeds
    ``0..train_seeds-1``, then re-measured on ``test_seeds`` other seeds (1000 on): (parameters,
    train ratios, held-out ratios), or None when none fits. The default router it is measured
    against always runs in :class:`Sim`. Raises ValueError for fewer than one train or test seed."""
    if train_seeds < 1 or test_seeds < 1:
        raise ValueError(f"policy_search needs train_seeds and test_seeds >= 1, got {train_seeds}, {test_seeds}")
    rng = random.Random(seed)
    make, ranges = make or tuned_policy, ranges or TUNED_RANGES

    defaults: dict[int, tuple[float, float]] = {}

    def measure(params: dict, seeds: range) -> tuple[float, float]:
        for s in seeds:
            if s not in defaults:
                defaults[s] = simulate(choose_queue_policy(False), s)
        runs = [(simulate(make(**params), s, model=model), defaults[s]) for s in seeds]
        return (statistics.mean(c / dc for (c, _), (dc, _) in runs),
                statistics.mean(p / dp for (_, p), (_, dp) in runs))

    best = None
    for _ in range(candidates):
        params = {name: rng.uniform(lo, hi) for name, (lo, hi) in ranges.items()}
        changes, p99 = measure(params, range(train_seeds))
        if p99 <= bound and (best is None or changes < best[1][0]):
            best = (params, (changes, p99))
    if best is None:
        return None
    return best[0], best[1], measure(best[0], range(1000, 1000 + test_seeds))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=16, help="noise seeds averaged per choose_queue policy")
    ap.add_argument("--lookahead-seeds", type=int, default=3, help="noise seeds of each lookahead row (slow)")
    ap.add_argument("--switch-costs", type=float, nargs="+", default=[0.1, 0.2, 0.25])
    ap.add_argument("--target-s", type=float, default=0.6, help="lookahead: latency over this is penalised")
    ap.add_argument("--weights", type=float, nargs="+", default=[5.0, 20.0], help="lookahead: λ per second over")
    ap.add_argument("--horizon-s", type=float, default=1.5)
    ap.add_argument("--futures", type=int, default=6)
    ap.add_argument("--beam", type=int, default=300)
    ap.add_argument("--hindsight-seeds", type=int, default=0,
                    help="noise seeds of each hindsight row (about 1 min per seed and weight; 0: no rows)")
    ap.add_argument("--hindsight-beam", type=int, default=10)
    ap.add_argument("--hindsight-horizon-s", type=float, default=1.0)
    ap.add_argument("--hindsight-futures", type=int, default=4)
    ap.add_argument("--search-candidates", type=int, default=500,
                    help="policy search: tuned_policy parameter draws (about 25 ms each per train seed; 0: no row)")
    ap.add_argument("--search-train-seeds", type=int, default=8)
    ap.add_argument("--search-test-seeds", type=int, default=16)
    ap.add_argument("--search-bound", type=float, default=1.08,
                    help="policy search: the p99 / default a candidate may have on the train seeds")
    ap.add_argument("--join-search-candidates", type=int, default=300,
                    help="joining: joining_policy parameter draws for JoinSim (0: no row)")
    ns = ap.parse_args()

    def ratios(make, seeds: int, model: type[Sim] = Sim):
        """Mean changes / default and p99 / default over ``seeds`` seeds, each against the
        default router's run with the same noise, and their (min, max) over the seeds."""
        runs = [(simulate(make(seed), seed, model=model), defaults[seed]) for seed in range(seeds)]
        changes = [c / dc for (c, _), (dc, _) in runs]
        p99 = [p / dp for (_, p), (_, dp) in runs]
        return statistics.mean(changes), (min(changes), max(changes)), statistics.mean(p99), (min(p99), max(p99))

    defaults = [simulate(choose_queue_policy(False), seed)
                for seed in range(max(ns.seeds, ns.lookahead_seeds, ns.hindsight_seeds))]
    print(f"bench/batching.py's mixed workload, simulated (3 rounds of 100 requests per noise seed)")
    print(f"  {'default':36s}: {statistics.mean(c for c, _ in defaults):5.1f} state changes per 100 requests, "
          f"p99 {statistics.mean(p for _, p in defaults) * 1e3:.0f} ms")
    rows = [(f"affinity, switch {c * 1e3:g} ms", ns.seeds, lambda _, c=c: choose_queue_policy(True, c))
            for c in ns.switch_costs]
    rows += [(f"lookahead, λ {w:g}/s over {ns.target_s * 1e3:g} ms", ns.lookahead_seeds,
              lambda seed, w=w: lookahead_policy(ns.target_s, w, ns.horizon_s, ns.futures, seed)) for w in ns.weights]
    rows += [(f"lookahead, true future, λ {w:g}/s", ns.lookahead_seeds,
              lambda seed, w=w: lookahead_policy(ns.target_s, w, ns.horizon_s, ns.futures, seed, true_future=True))
             for w in ns.weights]
    if ns.hindsight_seeds:
        rows += [(f"hindsight, λ {w:g}/s over {ns.target_s * 1e3:g} ms", ns.hindsight_seeds,
                  lambda seed, w=w: hindsight_policy(ns.target_s, w, ns.hindsight_horizon_s, ns.hindsight_beam,
                                                     ns.hindsight_futures, seed)) for w in ns.weights]
    c = scheduling.DEFAULT_SWITCH_COST_S
    rows.append((f"joining, switch {c * 1e3:g} ms", ns.seeds, lambda _: joining_policy(c), JoinSim))
    for name, seeds, make, *model in [row for row in rows if row[1]]:
        changes, (c_lo, c_hi), p99, (p_lo, p_hi) = ratios(make, seeds, *model)
        print(f"  {name:36s}: changes / default {changes:.2f} ({c_lo:.2f}-{c_hi:.2f}), "
              f"p99 / default {p99:.2f} ({p_lo:.2f}-{p_hi:.2f}), {seeds} seeds")

    searches = [(f"tuned by policy search ({ns.search_candidates})", ns.search_candidates, {}),
                (f"joining, tuned ({ns.join_search_candidates})", ns.join_search_candidates,
                 {"make": joining_policy, "ranges": JOIN_RANGES, "model": JoinSim})]
    for name, candidates, kind in searches:
        if not (candidates and ns.search_train_seeds and ns.search_test_seeds):
            continue
        found = policy_search(candidates, ns.search_train_seeds, ns.search_test_seeds, ns.search_bound, **kind)
        if found is None:
            print(f"  {name:36s}: no candidate at p99 / default <= {ns.search_bound:g}")
        else:
            params, (c_train, p_train), (c_test, p_test) = found
            print(f"  {name:36s}: changes / default {c_test:.2f}, p99 / default {p_test:.2f} on "
                  f"{ns.search_test_seeds} held-out seeds ({c_train:.2f} at {p_train:.2f} on {ns.search_train_seeds} "
                  f"train seeds); {', '.join(f'{k} {v:.3f}' for k, v in params.items())}")
    exact_changes, exact_p99 = simulate(choose_queue_policy(False), 0, rounds=1, noise=0.0)
    best = clairvoyant(1.10 * exact_p99, ns.beam)
    if best is None:
        print("  clairvoyant: no schedule found")
    else:
        print(f"  {'clairvoyant (offline, noise-free)':36s}: changes / default {best.changes / exact_changes:.2f}, "
              f"max latency / default p99 {max(best.latencies) / exact_p99:.2f}")
    print("  target: changes / default <= 0.5 at p99 / default <= 1.10")


if __name__ == "__main__":
    main()
