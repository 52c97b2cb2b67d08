"""deployments.live_config: a bad user_config update fails a starting replica and is refused
(settings in force kept, the refusal recorded) on a running one."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from deployments.config import BatchingConfig
from deployments.live_config import LiveUpdates


def test_a_bad_update_fails_the_start_and_is_refused_once_serving():
    applied = []

    def apply(knobs: dict) -> None:
        applied.append(BatchingConfig.model_validate(knobs).max_batch_size)

    live = LiveUpdates("Router")
    with pytest.raises(ValidationError, match="max_batch_size"):
        asyncio.run(live.apply({"max_batch_size": 0}, apply))  # at start: the deploy fails
    asyncio.run(live.apply({"max_batch_size": 4}, apply))
    live.started()
    asyncio.run(live.apply({"max_batch_size": 0}, apply))  # serving: refused, not raised
    assert applied == [4] and "max_batch_size" in live.refused["error"] and live.refused["at"] > 0
    # one line naming the field, as at start (was pydantic's "1 validation error for ..." dump)
    assert live.refused["error"].startswith("max_batch_size: Input should be") and "\n" not in live.refused["error"]

    async def apply_later(knobs: dict) -> None:  # a coroutine function (DiTReplica's adapter checks)
        apply(knobs)

    asyncio.run(live.apply({"max_batch_size": 8}, apply_later))
    assert applied == [4, 8] and live.refused is None  # an update that applies clears the refusal


def test_a_router_deployment_with_no_replica_left_is_503_not_500():
    """A failed redeploy of the Router leaves its deployment without replicas: Serve's handle
    raises DeploymentUnavailableError, which a client gets as 503 ``unavailable`` (was a 500
    "internal error"), and ``/health`` answers the same."""
    from ray.serve.exceptions import DeploymentUnavailableError

    from deployments.http import as_ditserve_error

    error = as_ditserve_error(DeploymentUnavailableError("Router"))
    assert error.status_code == 503 and error.code == "unavailable" and "serve status" in error.message


def _running(cls, **attributes):
    """A running replica of deployment class ``cls`` as far as its ``reconfigure`` reads it (its
    ``__init__`` needs a Serve replica context), serving: a bad update is refused, not raised."""
    replica = object.__new__(cls)
    replica._live = LiveUpdates(cls.__name__)
    replica._live.started()
    replica.__dict__.update(attributes)
    return replica


@pytest.mark.parametrize("update, problem", [
    # a flat acceleration field beside the sections: put it under acceleration (helper-43: the
    # message said the Ingress took no such field, where its flat form does)
    ({"acceleration": {}, "enable_cache_dit": True}, "user_config has enable_cache_dit beside its sections "
                                                     "(acceleration, loras): with sections an acceleration field "
                                                     "goes under acceleration"),
    ({"loras": {}, "cfg_gate_step": 0.5}, "user_config has cfg_gate_step beside its sections"),
    ({"loras": {}, "bogus": 1}, "user_config has no bogus (it takes acceleration, loras)"),
    ({"acceleration": [1]}, "user_config.acceleration must be a mapping"),
    ({"acceleration": "fast"}, "user_config.acceleration must be a mapping"),
    ({"loras": ["magenta"]}, "user_config.loras must be a mapping"),
    # before the model is known: default knobs past limits.default_steps (helper-62: taken unchecked)
    ({"acceleration": {"enable_cache_dit": True, "cache_dit_params": {"max_warmup_steps": 50}}},
     "acceleration.cache_dit_params does not fit limits.default_steps: cache_dit_params.max_warmup_steps must be at "
     "most num_inference_steps (12), got 50"),
])
def test_a_live_ingress_update_with_a_key_it_would_not_read_is_refused(update, problem):
    """A live ``serve deploy`` of the Ingress's ``user_config`` gets the config file's checks: a
    flat acceleration field beside the nested form was taken silently (ignored), a section that
    is not a mapping raised ``TypeError`` (which stops the replica: DEPLOY_FAILED)."""
    from deployments.config import AccelerationConfig
    from deployments.ingress import Ingress
    from pipeline.sampling import AccelerationDefaults

    defaults = AccelerationDefaults.from_config(AccelerationConfig(cfg_gate_step=0.5).model_dump())
    ingress = _running(Ingress.func_or_class, _config={"model": {"device": "cpu", "dtype": "float32"},
                                                       "limits": {"default_steps": 12},
                                                       "acceleration": {"cfg_gate_step": 0.5}},
                       _defaults=defaults, _loras={"magenta": {}}, _limits=None)
    asyncio.run(ingress.reconfigure(update))
    assert problem in ingress._live.refused["error"]
    assert ingress._defaults == defaults and ingress._loras == {"magenta": {}}  # the settings in force stay
    asyncio.run(ingress.reconfigure({"acceleration": {"cfg_gate_step": 0.25}}))  # a good one applies
    assert ingress._live.refused is None and ingress._defaults.cfg_gate_fraction == 0.25


@pytest.mark.parametrize("args, parallel, update, problem", [
    ({}, {}, {"torch_compile": True}, "acceleration.torch_compile is set where the replicas start"),
    ({}, {}, {"warmup": True}, "acceleration.warmup is set where the replicas start"),
    ({"torch_compile": True}, {}, {"compile_backend": "eager"}, "acceleration.compile_backend is set"),
    ({}, {"ring_degree": 2}, {"attention_backend": "torch_sdpa"}, "kernel is fixed (parallel.ring_degree=2"),
    ({"torch_compile": True}, {}, {"attention_backend": "torch_math"}, "kernel is fixed (acceleration.torch_compile on"),
    ({}, {}, {"enable_cache_dit": True, "cache_dit_params": {"Fn_compute_blocks": 20}},
     "acceleration.cache_dit_params does not fit the model and its limits.default_steps: cache_dit_params: "
     "Fn_compute_blocks + Bn_compute_blocks = 20 exceeds the model's 10 transformer blocks"),
    # knobs that would cache nothing: refused also while off by default, for whoever turns it on
    # (helper-54), and with no step count (max_continuous_cached_steps 0)
    ({}, {}, {"enable_cache_dit": False, "cache_dit_params": {"Fn_compute_blocks": 10}},
     "does not fit the model: cache_dit_params: Fn_compute_blocks + Bn_compute_blocks = 10 leaves no block"),
    ({}, {}, {"cache_dit_params": {"max_continuous_cached_steps": 0}},
     "cache_dit_params.max_continuous_cached_steps must be -1 (no limit) or at least 1, got 0"),
    # on by default, the knobs run every request that leaves out num_inference_steps (12 here)
    ({}, {}, {"enable_cache_dit": True, "cache_dit_params": {"max_warmup_steps": 12}},
     "limits.default_steps: cache_dit_params.max_warmup_steps (12) must be below the 12 steps that run"),
    ({}, {}, {"enable_cache_dit": True}, ""),  # cache-dit's own defaults fit 12 steps: taken (below)
])
def test_a_live_ingress_update_the_replicas_would_not_follow_is_refused(args, parallel, update, problem):
    """Acceleration fields the replicas read at their start (torch.compile, warmup) were taken
    by a live Ingress update and ignored; a default kernel other than the start's, under ring
    attention or torch.compile (where a request may not switch it), was taken and every batch
    switched to it; default Cache-DiT knobs beyond the model's blocks were taken and every
    request using them failed 500 in its batch. Each is refused now, the settings in force kept;
    other defaults still change live."""
    from deployments.config import AccelerationConfig
    from deployments.ingress import Ingress
    from pipeline.contract.limits import ServingLimits
    from pipeline.sampling import AccelerationDefaults

    started = AccelerationConfig.model_validate(args).model_dump()
    defaults = AccelerationDefaults.from_config(started)
    limits = ServingLimits("tiny-flux", 8, 64, 64, 12, 3.5, num_blocks=10)
    ingress = _running(Ingress.func_or_class, _config={"model": {"device": "cpu", "dtype": "float32"},
                                                       "limits": {"default_steps": 12},
                                                       "parallel": parallel, "acceleration": started},
                       _defaults=defaults, _loras={}, _limits=limits)
    asyncio.run(ingress.reconfigure({"acceleration": update}))
    if not problem:
        assert ingress._live.refused is None and ingress._defaults.enable_cache_dit
        return
    assert problem in ingress._live.refused["error"], ingress._live.refused
    assert ingress._defaults == defaults
    asyncio.run(ingress.reconfigure({"acceleration": {"cfg_gate_step": 0.25, "cache_dit_params": {"Fn_compute_blocks": 2},
                                                      "attention_backend": started["attention_backend"]}}))
    assert ingress._live.refused is None and ingress._defaults.cfg_gate_fraction == 0.25


@pytest.mark.parametrize("update, problem", [
    ({"lorass": {"late": {}}}, "user_config has no lorass (it takes loras)"),
    ({"loras": [{"name": "late"}]}, "user_config.loras must be a mapping"),
])
def test_a_live_replica_update_with_a_key_it_would_not_read_is_refused(update, problem):
    """DiTReplica read only ``loras``: a misspelt key was an empty registry, every adapter
    dropped without a word."""
    from deployments.replica import DiTReplica

    replica = _running(DiTReplica.func_or_class, _loras={"magenta": {}}, _refused_loras={})
    asyncio.run(replica.reconfigure(update))
    assert problem in replica._live.refused["error"] and replica._loras == {"magenta": {}}
