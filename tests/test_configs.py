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
