"""The router's queue choice as a table: (queues, replicas) -> which queue, why, for whom."""

from __future__ import annotations

import pytest

from deployments.scheduling import Decision, QueueView, ReplicaView, choose_queue, is_urgent, next_wakeup_s
from pipeline.modes import Priority

KW = dict(max_batch_size=4, max_wait_s=0.010, max_affinity_wait_s=0.5, switch_cost_s=0.25)


def q(sig, age, images=1):
    return QueueView(sig, age, images, float(images))


def r(rid, state, busy=False):
    return ReplicaView(rid, state, busy)


@pytest.mark.parametrize("queues, replicas, expected", [
    # nothing ready yet (young head, not full)
    ([q("A", 0.001)], [r("1", None)], None),
    # full queue is ready at once
    ([q("A", 0.001, images=4)], [r("1", None)], Decision("A", "miss", "1")),
    # no free replica: nothing is formed (late binding)
    ([q("A", 1.0)], [r("1", "A", busy=True)], None),
    # hit: a free replica already in the state
    ([q("A", 0.02)], [r("1", "B"), r("2", "A")], Decision("A", "hit", "2")),
    # oldest ready queue whose matching replica is busy waits; a younger one with a free match goes
    ([q("A", 0.2), q("B", 0.02)], [r("1", "A", busy=True), r("2", "B")], Decision("B", "hit", "2")),
    # matching replica busy, nothing else to do: wait for it (below the switch cost)
    ([q("A", 0.2)], [r("1", "A", busy=True), r("2", "B")], None),
    # ... until the head starves: any free replica takes it
    ([q("A", 0.6)], [r("1", "A", busy=True), r("2", "B")], Decision("A", "starvation", "2")),
    # a starving queue goes before a hit
    ([q("A", 0.6), q("B", 0.55)], [r("1", "A", busy=True), r("2", "B")], Decision("A", "starvation", "2")),
    # a signature no replica holds takes a free replica, preferring one whose state nobody wants
    ([q("C", 0.02), q("A", 0.001)], [r("1", "A"), r("2", "B")], Decision("C", "miss", "2")),
    # fresh replicas switch first
    ([q("C", 0.02)], [r("1", "A"), r("2", None)], Decision("C", "miss", "2")),
    # a free replica whose own state still has queued work does not switch away from it
    ([q("C", 0.02), q("A", 0.001)], [r("1", "A"), r("2", "B", busy=True)], None),
    # a switch goes to the longest-waiting queue; equal waits: the serving order (oldest head first)
    ([q("C", 0.03), q("D", 0.02, images=3)], [r("1", "A")], Decision("C", "miss", "1")),
    # a replica leaves queued work in its state for a queue older by more than the switch cost
    ([q("C", 0.25), q("A", 0.04)], [r("1", "A")], Decision("A", "hit", "1")),
    ([q("C", 0.30), q("A", 0.04)], [r("1", "A"), r("2", "B")], Decision("C", "miss", "2")),
    ([q("C", 0.30), q("A", 0.001)], [r("1", "A")], Decision("C", "miss", "1")),
    # ... also when its own queue is not ready yet (it waits for it otherwise)
    ([q("C", 0.20), q("A", 0.001)], [r("1", "A")], None),
    # a queue held by a busy replica waits for it while younger than the switch cost, then a
    # free replica switches for it (before the starvation bound)
    ([q("A", 0.2)], [r("1", "A", busy=True), r("2", "B")], None),
    ([q("A", 0.3)], [r("1", "A", busy=True), r("2", "B")], Decision("A", "miss", "2")),
    # of two switches, the unheld queue wins over the busy replica's (its next hit stays)
    ([q("A", 0.4), q("C", 0.3)], [r("1", "A", busy=True), r("2", "B")], Decision("C", "miss", "2")),
    # two free replicas in one state: one waits for that state's young queue, the other switches
    ([q("C", 0.02, images=4), q("A", 0.001)], [r("1", "A"), r("2", "A")], Decision("C", "miss", "2")),
])
def test_affinity_table(queues, replicas, expected):
    assert choose_queue(queues, replicas, **KW) == expected


@pytest.mark.parametrize("idle_s, max_wait_s, affinity, expected", [
    (5.0, 0.010, True, Decision("A", "hit", "1")),   # a lone request at an idle deployment goes at once
    (5.0, 0.010, False, Decision("A", "fifo", "1")),
    (0.005, 0.010, True, None),  # the last batch ended 4 ms before it came: followers still gather
    (0.020, 0.010, True, Decision("A", "hit", "1")),  # idle max_wait_ms before it came
    (0.050, 600.0, True, None),  # a long max_wait_ms: the gap needed is IDLE_GAP_S (0.1 s)
    (0.200, 600.0, True, Decision("A", "hit", "1")),
    (None, 0.010, True, None),   # a batch is in flight: wait for company
])
def test_a_lone_request_at_an_idle_deployment_does_not_wait(idle_s, max_wait_s, affinity, expected):
    lone = q("A", 0.001)
    assert choose_queue([lone], [r("1", "A"), r("2", "B")], idle_s=idle_s, affinity=affinity,
                        **{**KW, "max_wait_s": max_wait_s}) == expected


def u(sig, age, urgent_age, images=1):  # a queue holding urgent work (interactive, or starving batch)
    return QueueView(sig, age, images, float(images), urgent_age)


@pytest.mark.parametrize("queues, replicas, affinity, expected", [
    # interactive work first, although the batch queue is older
    ([q("B", 0.5), u("I", 0.02, 0.02)], [r("1", None)], True, Decision("I", "miss", "1")),
    ([q("B", 0.5), u("I", 0.02, 0.02)], [r("1", None)], False, Decision("I", "fifo", "1")),
    # the oldest urgent request first, among queues with urgent work
    ([u("I", 0.5, 0.02), u("J", 0.03, 0.03)], [r("1", None)], False, Decision("J", "fifo", "1")),
    # a free replica holding batch work's state switches for urgent work no replica holds
    ([q("B", 0.5), u("I", 0.02, 0.02)], [r("1", "B")], True, Decision("I", "miss", "1")),
    # urgent work waiting for its busy matching replica: batch work uses the free one
    ([q("B", 0.5), u("I", 0.02, 0.02)], [r("1", "I", busy=True), r("2", "B")], True, Decision("B", "hit", "2")),
    # ... until it is older than the switch cost: batch work in the free replica's state does not hold it
    ([q("B", 0.4), u("I", 0.3, 0.3)], [r("1", "I", busy=True), r("2", "B")], True, Decision("I", "miss", "2")),
    # urgent work still gathering company (not ready): the free replica waits for it, not
    # taken by batch work for a whole batch (a review's example: batch work ran first)
    ([q("B", 0.5), u("I", 0.001, 0.001)], [r("1", None)], True, None),
    ([q("B", 0.5), u("I", 0.001, 0.001)], [r("1", None)], False, None),
    ([q("B", 0.5), u("I", 0.001, 0.001)], [r("1", "B")], True, None),
    # ... one replica per gathering urgent queue: batch work takes another free one, the one
    # in the urgent queue's state stays for it
    ([q("B", 0.5), u("I", 0.001, 0.001)], [r("1", "I"), r("2", "B")], True, Decision("B", "hit", "2")),
    ([q("B", 0.5), u("I", 0.001, 0.001)], [r("1", "B"), r("2", "I")], True, Decision("B", "hit", "1")),
    ([q("B", 0.5), u("I", 0.001, 0.001)], [r("1", "I"), r("2", "B")], False, Decision("B", "fifo", "2")),
    ([q("B", 0.5), u("I", 0.001, 0.001), u("J", 0.002, 0.002)], [r("1", "I"), r("2", "B")], True, None),
    # ... otherwise one whose state batch work does not want (batch work keeps its hit)
    ([q("B", 0.5), u("I", 0.001, 0.001)], [r("1", "B"), r("2", "C")], True, Decision("B", "hit", "1")),
    # no urgent work queued at all: batch work flows as before
    ([q("B", 0.5)], [r("1", None)], True, Decision("B", "miss", "1")),
])
def test_priority_table(queues, replicas, affinity, expected):
    assert choose_queue(queues, replicas, affinity=affinity, **KW) == expected


def test_batch_work_becomes_urgent_at_its_starvation_bound():
    assert is_urgent(Priority.INTERACTIVE, 0.0, 30.0)
    assert not is_urgent(Priority.BATCH, 29.9, 30.0)
    assert is_urgent(Priority.BATCH, 30.0, 30.0)


def test_without_affinity_oldest_ready_queue_wins():
    queues = [q("A", 0.02), q("B", 0.05)]
    assert choose_queue(queues, [r("1", "A")], affinity=False, **KW) == Decision("B", "fifo", "1")


def test_cost_cap_makes_a_queue_ready():
    heavy = QueueView("A", 0.0, 1, 1e6)
    assert choose_queue([heavy], [r("1", None)], max_batch_cost=5e5, **KW) == Decision("A", "miss", "1")
    assert choose_queue([heavy], [r("1", None)], **KW) is None


def test_next_wakeup_is_the_nearest_bound():
    assert next_wakeup_s([], max_wait_s=0.01, max_affinity_wait_s=0.5) is None
    assert next_wakeup_s([q("A", 0.004)], max_wait_s=0.01, max_affinity_wait_s=0.5) == pytest.approx(0.006)
    assert next_wakeup_s([q("A", 0.1)], max_wait_s=0.01, max_affinity_wait_s=0.5) == pytest.approx(0.15)  # switch cost
    assert next_wakeup_s([q("A", 0.3)], max_wait_s=0.01, max_affinity_wait_s=0.5) == pytest.approx(0.2)


@pytest.mark.parametrize("fields, limit, said", [
    ({"n": 3}, 2 * 64 * 48, ("n", "ask for n at most 2")),  # helper-79: n alone past it was told 'size'
    ({"n": 2, "size": (128, 128)}, 128 * 128, ("n", "ask for n at most 1")),
    ({}, 64 * 48 - 1, ("size", "a smaller size")),
    ({"num_frames": 9}, 64 * 48 * 8, ("size", "a smaller size or fewer frames (num_frames, seconds)")),
    # a reference edit past it by its input images alone names them (helper-82: 'size')
    ({"input_mode": "reference", "num_input_images": 3}, 64 * 48 * 3, ("image", "give at most 2 input images")),
    ({"input_mode": "reference", "num_input_images": 3}, 64 * 48, ("size", "a smaller size")),
])
def test_a_request_past_max_batch_cost_is_told_the_field_that_alone_makes_it_fit(fields, limit, said):
    from deployments.router import cost_fix, request_cost
    from pipeline.modes import InputMode
    from tests.helpers import flux_params

    import dataclasses

    params = flux_params("p", 1, n=fields.get("n", 1), size=fields.get("size", (64, 48)),
                         input_mode=InputMode(fields.get("input_mode", "text")),
                         num_input_images=fields.get("num_input_images", 0))
    params = dataclasses.replace(params, num_frames=fields.get("num_frames", 1))
    assert request_cost(params) > limit
    assert cost_fix(params, limit) == said
