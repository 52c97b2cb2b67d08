"""LoRA adapters in a request: the ``lora`` field, the registry it names, and the resolved set.

Adapters are registered in the configuration by name (``model.loras``: name -> local path and
default scale), never by a path in a request. A request names up to ``limits.max_loras`` of
them, each with a scale; ``model: "<base>:<adapter>"`` names one for clients that can only set
``model``. The resolved set (:class:`LoraSpec` tuples, sorted by name) is part of the batch
signature. Torch-free: the Ingress imports it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.contract.text import shown

# A scale outside this range only saturates or inverts the adapter; the bound keeps it finite.
LORA_SCALE_RANGE = (-4.0, 4.0)
# Registered names: letters, digits, '.', '_' and '-', at most 64, not starting with '.' (never a path).
LORA_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")
MODEL_ADAPTER_SEPARATOR = ":"  # model "<base>:<adapter>"


@dataclass(frozen=True)
class LoraSpec:
    """One adapter of a resolved request: its registered ``name``, the ``scale`` its LoRA
    delta is multiplied by (diffusers' ``set_adapters`` weight) and the registered ``path``
    (a local file or directory from the configuration, never from a request)."""

    name: str
    scale: float
    path: str


def name_problem(field: str, name: object) -> str | None:
    """Why ``name`` cannot name a registered adapter (None: it can)."""
    if not isinstance(name, str) or not name:
        return f"{field} must be a non-empty adapter name, got {shown(name)}"
    if not LORA_NAME_RE.fullmatch(name):
        return (f"{field} must be a registered adapter name (letters, digits, '.', '_', '-'; at most 64; no paths), "
                f"got {shown(name)}")
    return None


def scale_problem(field: str, scale: float) -> str | None:
    """Why ``scale`` is not a usable adapter scale (None: it is)."""
    low, high = LORA_SCALE_RANGE
    if not math.isfinite(scale) or not low <= scale <= high:
        return f"{field} must be a finite number in [{low:g}, {high:g}], got {scale}"
    return None


class LoraRequest(BaseModel):
    """One entry of a request's ``lora`` list: a registered adapter ``name`` and its ``scale``
    (None: the adapter's configured ``default_scale``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    # what each field takes, for a 400 whose value has the wrong type (pipeline.contract.base.describe_error)
    ALLOWED: ClassVar[dict[str, str]] = {
        "name": "a registered adapter's name (GET /v1/models lists them as '<model>:<name>')",
        "scale": f"a number in [{LORA_SCALE_RANGE[0]:g}, {LORA_SCALE_RANGE[1]:g}] (default: the adapter's "
                 "default_scale)",
    }

    name: str = Field(max_length=64)
    scale: float | None = Field(default=None, allow_inf_nan=True)  # NaN/inf get our own message below

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        problem = name_problem("", v)  # the error describer prefixes the path (lora.0.name)
        if problem:
            raise ValueError(problem.strip())
        return v

    @field_validator("scale")
    @classmethod
    def _scale(cls, v: float | None) -> float | None:
        problem = None if v is None else scale_problem("", v)
        if problem:
            raise ValueError(problem.strip())
        return v


@dataclass(frozen=True)
class LoraEntry:
    """A registered adapter: its local ``path`` and the scale used when a request gives none."""

    path: str
    default_scale: float = 1.0


def split_model(model: str, base: str) -> str | None:
    """The adapter a ``model`` value names (``"<base>:<adapter>"``), or None for the base model
    itself; raises ``KeyError`` when it names another model."""
    if model == base:
        return None
    prefix = base + MODEL_ADAPTER_SEPARATOR
    if model.startswith(prefix):
        return model[len(prefix):]
    raise KeyError(model)


def adapter_model_id(base: str, name: str) -> str:
    """The model id of adapter ``name`` in ``GET /v1/models`` (``"<base>:<name>"``)."""
    return f"{base}{MODEL_ADAPTER_SEPARATOR}{name}"


def resolve_loras(requested: list[LoraRequest] | None, model_adapter: str | None,
                  registry: dict[str, LoraEntry]) -> tuple[LoraSpec, ...]:
    """The request's adapter set, sorted by name: ``model_adapter`` (at its default scale)
    and every ``lora`` entry. Names are checked against ``registry`` by the caller. An adapter
    at scale 0 is left out: its delta times 0 adds exact zeros, so the request is the base
    model's and batches with it (``-0.0`` and ``0`` had made two signatures, and the adapter
    was loaded for nothing)."""
    specs = [LoraSpec(model_adapter, registry[model_adapter].default_scale, registry[model_adapter].path)] \
        if model_adapter is not None else []
    for item in requested or ():
        entry = registry[item.name]
        specs.append(LoraSpec(item.name, entry.default_scale if item.scale is None else float(item.scale),
                              entry.path))
    return tuple(sorted((s for s in specs if s.scale != 0), key=lambda s: s.name))
