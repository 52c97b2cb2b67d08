"""``bench/affinity_sim.py``'s policy search is a search around the router's own rule: at its
special point the tuned policy makes the router's runs, and the search reports parameters
from its box with train and held-out ratios. Its model of step-level joining (``JoinSim``) is
the batch model when nothing joins, and lets a request join a running batch of its signature."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import affinity_sim as sim  # noqa: E402
import pytest  # noqa: E402


def test_tuned_policy_at_the_routers_point_is_the_router():
    for switch_cost_s in (0.1, 0.25):
        for seed in (0, 1):
            tuned = sim.simulate(sim.tuned_policy(switch_cost_s, 0.0, switch_cost_s, 0.0, 0.0), seed)
            assert tuned == sim.simulate(sim.choose_queue_policy(True, switch_cost_s), seed)


def test_policy_search_reports_parameters_from_its_box_and_held_out_ratios():
    found = sim.policy_search(candidates=3, train_seeds=1, test_seeds=1, bound=10.0)
    assert found is not None
    params, (train_changes, train_p99), (test_changes, test_p99) = found
    assert set(params) == set(sim.TUNED_RANGES)
    assert all(lo <= params[k] <= hi for k, (lo, hi) in sim.TUNED_RANGES.items())
    assert 0 < train_changes and 0 < train_p99 <= 10.0 and 0 < test_changes and 0 < test_p99
    assert sim.policy_search(candidates=2, train_seeds=1, test_seeds=1, bound=0.0) is None
    with pytest.raises(ValueError, match="train_seeds and test_seeds"):
        sim.policy_search(candidates=1, train_seeds=0, test_seeds=1, bound=10.0)


def test_join_sim_without_joins_is_the_batch_model():
    """Step by step, with the noise drawn once per batch: without joins every batch ends and is
    answered when :class:`Sim`'s does (the same runs, up to float rounding)."""
    class NoJoins(sim.JoinSim):
        joins = False

    for policy in (sim.choose_queue_policy(False), sim.choose_queue_policy(True, 0.25)):
        for seed in (0, 1):
            assert sim.simulate(policy, seed, model=NoJoins) == pytest.approx(sim.simulate(policy, seed))


def test_a_request_joins_a_running_batch_of_its_signature_at_the_next_step():
    model = sim.JoinSim([5] + [2] * 7)
    model.advance(sim.HOP_S, lambda m: 2)  # every client's first request has arrived
    model.dispatch(5, 0, sim.batch_s(5, 1))  # noise factor 1
    replica = model.replicas[0]
    first_step_end = replica.busy_until
    assert first_step_end == pytest.approx(sim.HOP_S + sim.F + sim.A + sim.C)
    model.queues[5] = [(model.t, model.t)]  # one more of signature 5, sent at HOP_S, queued meanwhile
    model.advance(first_step_end, lambda m: 2)
    assert [done for _, done in replica.rows] == [1, 0] and model.queues[5] == []
    assert replica.busy_until == pytest.approx(first_step_end + sim.A + 2 * sim.C + sim.JOIN_S)
    while replica.busy_until is not None:  # the first row ends after its 5 steps, the joined one a step later
        model.advance(replica.busy_until, lambda m: 2)
    first, joined = 0.0 + model.latencies[0], sim.HOP_S + model.latencies[1]  # answered at: sent + latency
    assert model.done == 2 and model.changes == 0
    assert first < joined < first + sim.A + sim.C + sim.D + sim.ANSWER_S  # not a whole batch after it
