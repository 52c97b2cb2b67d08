"""Every Serve config in configs/ is accepted by Ray Serve's schema and by AppConfig."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.cli import load_serve_config
from deployments.config import AppConfig

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates(path):
    ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    app = load_serve_config(path)
    AppConfig.model_validate(app["args"])


def test_misspelled_arg_is_caught():
    with pytest.raises(ValidationError, match="max_batch_sise"):
        AppConfig.model_validate({"batching": {"max_batch_sise": 4}})


@pytest.mark.parametrize("max_queued_requests, max_queued_batch_requests, expected", [
    (256, None, 192),  # default: three quarters of the queue for priority 'batch'
    (2, None, 1),      # at least one
    (1, None, 1),
    (64, 10, 10),      # as configured
    (64, 64, 64),      # no room kept for interactive work
])
def test_the_queue_share_of_batch_priority_work(max_queued_requests, max_queued_batch_requests, expected):
    from deployments.config import BatchingConfig, queued_batch_limit

    knobs = BatchingConfig(max_queued_requests=max_queued_requests, max_queued_batch_requests=max_queued_batch_requests)
    assert queued_batch_limit(knobs.max_queued_requests, knobs.max_queued_batch_requests) == expected


def test_batch_priority_work_cannot_have_more_of_the_queue_than_there_is():
    with pytest.raises(ValidationError, match=r"max_queued_batch_requests \(65\) must be <= max_queued_requests \(64\)"):
        AppConfig.model_validate({"batching": {"max_queued_requests": 64, "max_queued_batch_requests": 65}})
    with pytest.raises(ValidationError, match="max_queued_batch_requests"):
        AppConfig.model_validate({"batching": {"max_queued_batch_requests": 0}})


def test_a_deployments_entry_must_name_a_deployment_of_the_app():
    from deployments.app import bind_app

    with pytest.raises(ValueError, match="no deployment named 'Routr'.*DiTReplica, Ingress, Router"):
        bind_app({}, [{"name": "Routr", "user_config": {"max_batch_size": 3}}])
