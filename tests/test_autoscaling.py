"""DiTReplica autoscaling on the Router's queue depth, through real Ray Serve autoscaling."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from ray.serve.config import AutoscalingContext

from deployments.app import bind_app, build_app, deployment_options
from deployments.autoscaling import QUEUED_IMAGES, RouterQueuePolicy
from deployments.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]
# tiny-flux, 1..2 replicas of 1 CPU; Serve acts on a decision at once (upscale_delay_s: 0) and
# keeps the second replica for the rest of the test (downscale_delay_s: 600).
AUTOSCALE_ARGS = {
    "batching": {"max_batch_size": 1, "max_wait_ms": 0},
    "limits": {"max_n": 1},
    "replica": {"ray_actor_options": {"num_cpus": 1}, "torch_threads": 1,
                "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_queued_per_replica": 2,
                                "upscale_delay_s": 0, "downscale_delay_s": 600, "look_back_period_s": 2,
                                "metrics_interval_s": 0.5}},
}


def _context(queued: dict, busy: float, current: int = 1) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=None, deployment_name="DiTReplica", app_name="ditserve", current_num_replicas=current,
        target_num_replicas=current, running_replicas=[], total_num_requests=busy, total_queued_requests=0.0,
        aggregated_metrics={QUEUED_IMAGES: queued} if queued else {}, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=None)


@pytest.mark.parametrize("queued, busy, current, desired", [
    ({}, 0, 1, 1),                      # no report (the Router did not answer): hold at the target,
    ({}, 0, 2, 2),                      # not 0, which Serve took down to min_replicas after the delay
    ({}, 3, 2, 3),                      # ... unless more are busy
    ({"r1": 8.0}, 1, 1, 2),             # 8 images waiting, target 4 per replica
    ({"r1": 9.0, "r2": 3.0}, 2, 2, 3),  # the freshest (largest) report of the one Router counts
    ({"r1": 0.0, "r2": 0.0}, 2, 2, 2),  # empty queue but both replicas busy: keep them
    ({"r1": 0.0, "r2": 0.0}, 0.5, 2, 1),
    ({"r1": float("nan")}, 0, 2, 2),    # a report that is no number is none (helper-64: ValueError each tick)
    ({"r1": float("inf")}, 0, 2, 2),
    ({"r1": float("nan"), "r2": 8.0}, 0, 1, 2),
    ({"r1": 4.0}, float("nan"), 1, 1),  # Serve's own count, should it be NaN, counts no busy replica
])
def test_policy_table(queued, busy, current, desired):
    assert RouterQueuePolicy(target_queued_per_replica=4)(_context(queued, busy, current))[0] == desired


def test_a_metrics_interval_that_would_ask_the_router_without_a_pause_is_refused():
    """``args``' autoscaling had the bound; a ``deployments`` entry's did not (helper-65)."""
    entry = {"name": "DiTReplica", "autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                                          "metrics_interval_s": 1e-9, "look_back_period_s": 1}}
    with pytest.raises(ValueError, match="DiTReplica's autoscaling_config.metrics_interval_s must be at least 0.1 s"):
        bind_app(AUTOSCALE_ARGS, [entry])
    with pytest.raises(ValidationError, match="greater than or equal to 0.1"):
        AppConfig.model_validate({"replica": {"autoscaling": {"metrics_interval_s": 0.05, "look_back_period_s": 1}}})


def test_a_tiny_target_asks_for_the_most_replicas_not_an_overflow():
    """helper-64: target 1e-310 made queued / target infinite, and math.ceil raised on every tick."""
    from deployments.autoscaling import MAX_DESIRED_REPLICAS

    assert RouterQueuePolicy(target_queued_per_replica=1e-310)(_context({"r1": 3.0}, 1))[0] == MAX_DESIRED_REPLICAS


POLICY = "deployments.autoscaling:RouterQueuePolicy"


@pytest.mark.parametrize("autoscaling, words", [
    ({"policy": {"policy_function": POLICY}}, "missing 1 required positional argument: 'target_queued_per_replica'"),
    ({"policy": {"policy_function": POLICY, "policy_kwargs": {"target_queued_per_replica": 0}}}, "finite number > 0"),
    ({"policy": {"policy_function": POLICY, "policy_kwargs": {"target": 2}}}, "unexpected keyword argument 'target'"),
    ({"target_queued_per_replica": 8, "policy": {"policy_function": POLICY,
                                                  "policy_kwargs": {"target_queued_per_replica": 2}}}, "give one"),
])
def test_a_policy_serve_could_not_make_is_refused(autoscaling, words):
    """A DiTReplica ``autoscaling_config.policy`` naming ditserve's policy with missing or bad
    ``policy_kwargs`` passed ``--check``; Serve's controller then failed to make it every 100 ms
    and the deploy never ended (helper-64). A target beside a policy was dropped silently."""
    entry = {"name": "DiTReplica", "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, **autoscaling}}
    with pytest.raises(ValueError, match="autoscaling_config") as refused:
        bind_app(AUTOSCALE_ARGS, [entry])
    assert words in str(refused.value)
    fine = {"policy_function": POLICY, "policy_kwargs": {"target_queued_per_replica": 2}}
    bind_app(AUTOSCALE_ARGS, [{**entry, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "policy": fine}}])


@pytest.mark.parametrize("target", [0, -1, float("nan"), float("inf"), True])
def test_a_target_that_is_not_a_finite_positive_number_is_refused(target):
    """NaN was taken and raised on every autoscaling tick; inf silently scaled on busy alone."""
    with pytest.raises(ValueError, match="finite number > 0"):
        RouterQueuePolicy(target_queued_per_replica=target)
    with pytest.raises(ValueError, match="finite number > 0"):
        bind_app(AUTOSCALE_ARGS, [{"name": "DiTReplica", "autoscaling_config": {
            "min_replicas": 1, "max_replicas": 2, "target_queued_per_replica": target}}])


def test_config_becomes_serve_autoscaling_config_of_ditreplica():
    config = AppConfig.model_validate(AUTOSCALE_ARGS)
    options = deployment_options(config)["DiTReplica"]
    autoscaling = options["autoscaling_config"]
    assert "num_replicas" not in options
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.upscale_delay_s,
            autoscaling.downscale_delay_s, autoscaling.look_back_period_s) == (1, 2, 0, 600, 2)
    assert autoscaling.policy.policy_function == "deployments.autoscaling.RouterQueuePolicy"
    assert autoscaling.policy.policy_kwargs == {"target_queued_per_replica": 2.0}
    assert config.replica.initial_replicas == 1  # the Router's capacity before it sees the replica set
    build_app(AUTOSCALE_ARGS)  # Serve accepts these options
    # target_queued_per_replica defaults to the batching max_batch_size
    default = AppConfig.model_validate({"batching": {"max_batch_size": 4},
                                        "replica": {"autoscaling": {"max_replicas": 3}}})
    policy = deployment_options(default)["DiTReplica"]["autoscaling_config"].policy
    assert policy.policy_kwargs == {"target_queued_per_replica": 4}


def test_serves_scaling_factors_and_aggregation_pass_to_serve():
    """helper-43: the README said every field but target_queued_per_replica is Serve's
    AutoscalingConfig's, yet upscaling_factor was refused; Serve applies the factors and the
    aggregation to a custom policy too."""
    config = AppConfig.model_validate({"replica": {"autoscaling": {
        "max_replicas": 4, "upscaling_factor": 2, "downscaling_factor": 0.5, "aggregation_function": "max"}}})
    autoscaling = deployment_options(config)["DiTReplica"]["autoscaling_config"]
    assert (autoscaling.upscaling_factor, autoscaling.downscaling_factor) == (2, 0.5)
    assert str(autoscaling.aggregation_function.value) == "max"
    unset = deployment_options(AppConfig.model_validate(AUTOSCALE_ARGS))["DiTReplica"]["autoscaling_config"]
    assert (unset.upscaling_factor, unset.downscaling_factor) == (None, None)  # Serve's own: the whole change
    from deployments.config import validation_line

    with pytest.raises(ValidationError) as info:  # the policy scales on target_queued_per_replica
        AppConfig.model_validate({"replica": {"autoscaling": {"target_ongoing_requests": 2}}})
    assert "replica.autoscaling.target_ongoing_requests: no such field" in validation_line(info.value)


def test_a_deployments_entry_autoscaling_config_keeps_the_router_queue_policy():
    """``ditserve serve --config`` with DiTReplica's ``autoscaling_config`` in the ``deployments``
    section: the Router-queue policy, its target from the entry, args or ``max_batch_size`` (it was
    Serve's default policy, which scales on ongoing requests: one batch per DiTReplica at most);
    a policy the entry names stands."""
    from deployments.app import bind_app

    def replica_autoscaling(args, entry):
        ingress = bind_app(args, [{"name": "DiTReplica", **entry}])._bound_deployment
        replica = ingress.init_args[0]._bound_deployment.init_args[0]._bound_deployment
        return replica._deployment_config.autoscaling_config

    got = replica_autoscaling({"batching": {"max_batch_size": 4}},
                              {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}})
    assert (got.min_replicas, got.max_replicas) == (1, 3)
    assert got.policy.policy_function == "deployments.autoscaling.RouterQueuePolicy"
    assert got.policy.policy_kwargs == {"target_queued_per_replica": 4}
    got = replica_autoscaling({}, {"autoscaling_config": {"max_replicas": 3, "target_queued_per_replica": 6}})
    assert got.policy.policy_kwargs == {"target_queued_per_replica": 6}
    got = replica_autoscaling({"replica": {"autoscaling": {"max_replicas": 2, "target_queued_per_replica": 5}}},
                              {"autoscaling_config": {"max_replicas": 3}})
    assert got.policy.policy_kwargs == {"target_queued_per_replica": 5}
    named = {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}
    got = replica_autoscaling({}, {"autoscaling_config": {"max_replicas": 3, "policy": named}})
    assert got.policy.policy_function == named["policy_function"]
    with pytest.raises(ValueError, match="target_queued_per_replica must be a finite number > 0"):
        replica_autoscaling({}, {"autoscaling_config": {"max_replicas": 3, "target_queued_per_replica": 0}})
    # num_replicas "auto" (Serve's autoscaling defaults, 1..100 replicas) also scales on the Router's
    # queue: it ran Serve's default policy (helper-32's review), which never sees the Router's backlog
    got = replica_autoscaling({"batching": {"max_batch_size": 4}}, {"num_replicas": "auto"})
    assert (got.min_replicas, got.max_replicas) == (1, 100)
    assert got.policy.policy_function == "deployments.autoscaling.RouterQueuePolicy"
    assert got.policy.policy_kwargs == {"target_queued_per_replica": 4}
    got = replica_autoscaling({}, {"num_replicas": "auto", "autoscaling_config": {"max_replicas": 6}})
    assert (got.min_replicas, got.max_replicas, got.policy.policy_kwargs) == (1, 6, {"target_queued_per_replica": 8})


@pytest.mark.parametrize("args, deployments, said", [
    ({"replica": {"autoscaling": {"max_replicas": 2, "look_back_period_s": 1, "metrics_interval_s": 5}}}, [],
     "look_back_period_s (1.0) must be greater than metrics_interval_s (5.0)"),
    ({"replica": {"autoscaling": {"max_replicas": 2, "look_back_period_s": 10}}}, [],  # metrics_interval_s 10 s
     "look_back_period_s (10.0) must be greater than metrics_interval_s (10.0)"),
    ({}, [{"name": "DiTReplica", "autoscaling_config": {"max_replicas": 2, "look_back_period_s": 5}}],
     "DiTReplica's autoscaling_config.look_back_period_s (5.0) must be greater than metrics_interval_s (10.0)"),
    ({}, [{"name": "Ingress", "autoscaling_config": {"max_replicas": 2, "metrics_interval_s": 40}}],
     "Ingress's autoscaling_config.look_back_period_s (30.0) must be greater than metrics_interval_s (40.0)"),
    # as Serve reads them (helper-36's review: these passed): YAML reads 1e1 as the string "1e1"
    ({}, [{"name": "DiTReplica", "autoscaling_config": {"look_back_period_s": "1e1"}}],
     "look_back_period_s (10.0) must be greater than metrics_interval_s (10.0)"),
    ({}, [{"name": "Ingress", "autoscaling_config": {"look_back_period_s": True}}],
     "look_back_period_s (1.0) must be greater than metrics_interval_s (10.0)"),
    # Serve's own refusals name the deployment (a null blamed "args.autoscaling_config")
    ({}, [{"name": "Ingress", "autoscaling_config": {"look_back_period_s": None}}],
     "deployments: Ingress's autoscaling_config: look_back_period_s: Input should be a valid number"),
    ({}, [{"name": "DiTReplica", "autoscaling_config": {"look_back_period_s": -1}}],
     "deployments: DiTReplica's autoscaling_config: look_back_period_s: Input should be greater than 0"),
])
def test_a_look_back_period_no_longer_than_a_metrics_interval_is_refused(args, deployments, said):
    """Serve averages the queue over ``look_back_period_s`` of reports sent every
    ``metrics_interval_s``: one no longer than the other passed with Serve's FutureWarning ("will
    raise an exception in a future release") printed in ``--check``'s output (helper-32's review).
    Refused, naming the fields (and the deployment, for a ``deployments`` entry)."""
    from deployments.app import bind_app

    with pytest.raises((ValueError, ValidationError), match=re.escape(said)):
        bind_app(args, deployments)
    bind_app({"replica": {"autoscaling": {"max_replicas": 2, "look_back_period_s": 2, "metrics_interval_s": 0.5}}})


def test_flux_4gpu_config_autoscales_whole_placement_groups():
    from deployments.cli import load_serve_config

    args = load_serve_config(ROOT / "configs" / "flux-dev-4gpu.yaml")["args"]
    options = deployment_options(AppConfig.model_validate(args))["DiTReplica"]
    autoscaling = options["autoscaling_config"]
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 4)
    assert autoscaling.policy.policy_kwargs == {"target_queued_per_replica": 4}
    assert options["placement_group_bundles"] == [{"GPU": 1, "CPU": 8}] * 4
    assert options["placement_group_strategy"] == "STRICT_PACK"
    build_app(args)


@pytest.mark.parametrize("replica, message", [
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "max_replicas"),
    ({"autoscaling": {"min_replicas": 0}}, "min_replicas"),
    ({"autoscaling": {"max_replicas": 2, "initial_replicas": 3}}, "initial_replicas"),
    ({"num_replicas": 2, "autoscaling": {"max_replicas": 2}}, "not both"),
    ({"autoscaling": {"max_replica": 2}}, "max_replica"),
])
def test_bad_autoscaling_config_is_caught(replica, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate({"replica": replica})


def _replicas_running() -> int:
    from ray import serve

    app = serve.status().applications.get("ditserve")
    if app is None or "DiTReplica" not in app.deployments:
        return 0
    return app.deployments["DiTReplica"].replica_states.get("RUNNING", 0)


@pytest.mark.slow
def test_a_flooded_router_queue_adds_a_replica(deploy):
    from ray import serve

    deploy(AUTOSCALE_ARGS, fresh=True)
    handle = serve.get_app_handle("ditserve")
    assert _replicas_running() == 1
    # the limit the Ingress names for the proxy's gate counts a batch on each replica it may start
    assert handle.stats.remote().result()["ingress"]["admission_limit"] == 256 + 1 * 2
    body = lambda i: {"prompt": f"a shape {i}", "seed": i, "num_inference_steps": 8, "size": "64x64"}
    responses, sent, started = [], 0, time.monotonic()
    deadline = started + 240  # a bound on the wait, not a timing assertion
    while _replicas_running() < 2 and time.monotonic() < deadline:
        queued = handle.stats.remote().result()["router"]["queued"]
        for _ in range(max(0, 12 - queued)):  # keep the Router's queue above the target of 2 per replica
            responses.append(handle.generate.remote(body(sent)))
            sent += 1
        time.sleep(0.5)
    scaled_after_s = time.monotonic() - started
    assert _replicas_running() == 2, serve.status().applications["ditserve"].deployments["DiTReplica"]
    outputs = [r.result(timeout_s=300) for r in responses]
    assert len({o.ditserve["request_id"] for o in outputs}) == sent
    # The new replica takes batches: a burst after scale-up is spread over both.
    burst = [handle.generate.remote(body(sent + i)) for i in range(8)]
    replicas = {r.result(timeout_s=300).ditserve["replica"] for r in burst}
    stats = handle.stats.remote().result()["router"]
    print(f"second DiTReplica RUNNING {scaled_after_s:.1f}s after the flood began; {sent} requests flooded; "
          f"burst served by {len(replicas)} replicas; router knows {len(stats['replicas'])}")
    assert len(stats["replicas"]) == 2
    assert len(replicas) == 2
