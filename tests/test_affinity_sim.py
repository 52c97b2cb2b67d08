"""``bench/affinity_sim.py``'s policy search is a search around the router's own rule: at its
special point the tuned policy makes the router's runs, and the search reports parameters
from its box with train and held-out ratios."""

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
