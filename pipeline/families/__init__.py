"""Model-family adapters, registered by name. Each family's whole story lives in one module."""

from __future__ import annotations

import json
from pathlib import Path

FAMILIES: dict[str, type] = {}


def register(name: str):
    """Class decorator: make a family adapter loadable by ``name``."""

    def wrap(cls):
        cls.family = name
        FAMILIES[name] = cls
        return cls

    return wrap


def detect_family(path: str | Path) -> str:
    """Family of a diffusers checkpoint directory, from ``model_index.json``'s ``_class_name``.

    Raises ``ValueError`` if no registered family handles that pipeline class.
    """
    _import_all()
    class_name = json.loads((Path(path) / "model_index.json").read_text())["_class_name"]
    for name, cls in FAMILIES.items():
        if class_name in cls.pipeline_classes:
            return name
    raise ValueError(f"no ditserve family serves pipeline class {class_name!r}; known: {sorted(FAMILIES)}")


def load_family(name: str, path: str | Path, *, torch_dtype, device, **options):
    """Load the checkpoint at ``path`` with the adapter registered as ``name``; ``options``
    go to the adapter's ``from_pretrained`` (e.g. Wan's ``dual_transformer``)."""
    _import_all()
    _quiet_loading()
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name].from_pretrained(path, torch_dtype=torch_dtype, device=device, **options)


def _quiet_loading() -> None:
    """No per-component progress bars in server logs."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def _import_all() -> None:
    from pipeline.families import flux, wan  # noqa: F401  (register themselves)
