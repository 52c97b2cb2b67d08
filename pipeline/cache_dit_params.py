"""``cache_dit_params``: the per-request Cache-DiT override, as a frozen pydantic model (torch-free).

The knob names are cache-dit's own (``DBCacheConfig``: ``Fn_compute_blocks``,
``Bn_compute_blocks``, ``max_warmup_steps``, ``residual_diff_threshold``,
``max_continuous_cached_steps``; ``TaylorSeerCalibratorConfig``: ``taylorseer_order``). The
step-computation-mask keys follow cache-dit's ``steps_mask`` helper (presets
``slow | medium | fast | ultra``, or explicit ``compute_bins`` / ``cache_bins``; cache-dit's
README, "Steps Computation Masking"). ``secondary`` holds knobs for the second transformer of
a dual-transformer model; a knob it does not set is inherited from the primary's.

A key given ``null`` is unset, as if left out. A validated override is frozen and hashable: it is the Cache-DiT part of a batch signature
and of the replica state. Unknown keys, wrong types (no bool for an integer, no string for a
number) and values outside the bounds below are rejected with the field's dotted path.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Static bounds, before the request and the model are known (the request validator then checks
# against its own step count and the model's block count).
MAX_BLOCKS = 1024  # far above any DiT's depth (FLUX.1: 19 + 38 blocks, Wan 2.x 14B: 40)
MAX_STEPS = 10_000
# TaylorSeer keeps taylorseer_order derivatives of every cached activation; its paper
# (arXiv:2503.06923) and cache-dit recommend 1 or 2. Orders beyond 4 only cost memory.
MAX_TAYLORSEER_ORDER = 4
MAX_THRESHOLD = 1e6  # residual_diff_threshold is a relative L1 difference (typically 0.05..1)
# cache-dit's own defaults of the knobs a request may leave unset (``DBCacheConfig``), which
# validation counts with: its Fn must fit the blocks, its warmup must leave steps to cache
DEFAULT_FN_COMPUTE_BLOCKS = 8
DEFAULT_MAX_WARMUP_STEPS = 8
# What every unset knob runs as: cache-dit's ``DBCacheConfig`` and ``TaylorSeerCalibratorConfig``
# defaults (tests/test_accel.py checks them against the installed cache-dit); TaylorSeer off
KNOB_DEFAULTS = {"Fn_compute_blocks": DEFAULT_FN_COMPUTE_BLOCKS, "Bn_compute_blocks": 0,
                 "max_warmup_steps": DEFAULT_MAX_WARMUP_STEPS, "residual_diff_threshold": 0.08,
                 "max_continuous_cached_steps": -1, "enable_taylorseer": False, "taylorseer_order": 1}

SCM_PRESETS = ("none", "slow", "medium", "fast", "ultra")
SCM_POLICIES = ("dynamic", "static")
_Bin = Annotated[int, Field(strict=True, ge=1, le=MAX_STEPS)]


class CacheDiTKnobs(BaseModel):
    """DBCache knobs of one transformer; an unset knob is cache-dit's default.

    ``Fn_compute_blocks`` / ``Bn_compute_blocks``: blocks always computed at the front / back
    (Fn >= 1). ``max_warmup_steps``: first steps never cached. ``residual_diff_threshold`` (> 0):
    relative L1 change of the first blocks' residual below which a step is served from cache.
    ``max_continuous_cached_steps`` (-1: unlimited; 0 caches no step, except under a static SCM
    mask): cached steps in a row. ``enable_taylorseer`` / ``taylorseer_order`` (1..4): TaylorSeer
    forecasting of cached residuals. Knobs with which Cache-DiT would cache nothing are refused
    where it runs (``pipeline.contract.base.nothing_cached_problems``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    # what each knob takes, for a 400 whose value has the wrong type (pipeline.contract.base.describe_error)
    ALLOWED: ClassVar[dict[str, str]] = {
        "Fn_compute_blocks": "an integer of blocks >= 1, within the model's blocks "
                             f"(cache-dit's default {KNOB_DEFAULTS['Fn_compute_blocks']})",
        "Bn_compute_blocks": f"an integer of blocks >= 0 (cache-dit's default {KNOB_DEFAULTS['Bn_compute_blocks']})",
        "max_warmup_steps": "an integer of steps >= 0, below the steps that run "
                            f"(cache-dit's default {KNOB_DEFAULTS['max_warmup_steps']})",
        "residual_diff_threshold": f"a number > 0 and <= {MAX_THRESHOLD:g} (typically 0.05 to 1; cache-dit's "
                                   f"default {KNOB_DEFAULTS['residual_diff_threshold']:g})",
        "max_continuous_cached_steps": "an integer of steps >= -1 (-1: unlimited, cache-dit's default)",
        "enable_taylorseer": "true or false",
        "taylorseer_order": f"an integer from 1 to {MAX_TAYLORSEER_ORDER} (with enable_taylorseer)",
    }

    Fn_compute_blocks: int = Field(None, ge=1, le=MAX_BLOCKS)
    Bn_compute_blocks: int = Field(None, ge=0, le=MAX_BLOCKS)
    max_warmup_steps: int = Field(None, ge=0, le=MAX_STEPS)
    residual_diff_threshold: float = Field(None, gt=0, le=MAX_THRESHOLD, allow_inf_nan=False)
    max_continuous_cached_steps: int = Field(None, ge=-1, le=MAX_STEPS)
    enable_taylorseer: bool = None
    taylorseer_order: int = Field(None, ge=1, le=MAX_TAYLORSEER_ORDER)

    @model_validator(mode="before")
    @classmethod
    def _nulls_unset(cls, data: Any) -> Any:
        """A known key given ``null`` is unset (cache-dit's default), as ``null`` is a request
        field's default; an unknown one stays, to be refused. A ``secondary`` that sets no knob
        is no ``secondary``."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        secondary = data.get("secondary")
        if isinstance(secondary, dict) and all(v is None for k, v in secondary.items() if k in CacheDiTKnobs.model_fields) \
                and set(secondary) <= set(CacheDiTKnobs.model_fields):
            data.pop("secondary")
        return data

    def set_knobs(self) -> dict:
        """The knobs this override sets, by cache-dit's names (unset ones left out)."""
        return {name: getattr(self, name) for name in CacheDiTKnobs.model_fields if getattr(self, name) is not None}


def _runs_as(knobs: dict) -> dict:
    """Every knob as it runs (``KNOB_DEFAULTS`` under ``knobs``); ``taylorseer_order`` at its
    default without TaylorSeer, which ignores it."""
    full = {**KNOB_DEFAULTS, **knobs}
    if not full["enable_taylorseer"]:
        full["taylorseer_order"] = KNOB_DEFAULTS["taylorseer_order"]
    return full


class CacheDiTParams(CacheDiTKnobs):
    """The whole ``cache_dit_params`` object of a request.

    ``scm_preset`` or ``scm_compute_bins`` + ``scm_cache_bins`` (together; bins of steps >= 1)
    make a step-computation mask, run ``scm_policy`` (``dynamic``: cached steps still check the
    residual; ``static``: they never compute). ``secondary``: knobs of ``transformer_2``.
    """

    ALLOWED: ClassVar[dict[str, str]] = {
        "scm_preset": f"one of {', '.join(SCM_PRESETS)}",
        "scm_compute_bins": "a list of integers of steps >= 1, given with scm_cache_bins",
        "scm_cache_bins": "a list of integers of steps >= 1, given with scm_compute_bins",
        "scm_policy": f"one of {', '.join(SCM_POLICIES)}",
        "secondary": "an object of transformer_2's knobs: " + ", ".join(CacheDiTKnobs.model_fields),
    }

    scm_preset: Literal["none", "slow", "medium", "fast", "ultra"] = None
    scm_compute_bins: tuple[_Bin, ...] = Field(None, strict=False)
    scm_cache_bins: tuple[_Bin, ...] = Field(None, strict=False)
    scm_policy: Literal["dynamic", "static"] = None
    secondary: CacheDiTKnobs = None

    @model_validator(mode="after")
    def _masks(self) -> "CacheDiTParams":
        if (self.scm_compute_bins is None) != (self.scm_cache_bins is None):
            raise ValueError("scm_compute_bins and scm_cache_bins must be given together")
        if self.scm_compute_bins is not None and not (self.scm_compute_bins and self.scm_cache_bins):
            raise ValueError("scm_compute_bins and scm_cache_bins must not be empty")
        if self.scm_compute_bins is not None and self.scm_preset not in (None, "none"):
            raise ValueError("give either scm_preset or scm_compute_bins/scm_cache_bins, not both")
        return self

    @property
    def has_mask(self) -> bool:
        """Whether a step-computation mask is asked for (a preset other than none, or bins)."""
        return self.scm_compute_bins is not None or self.scm_preset not in (None, "none")

    def for_transformer(self, name: str) -> "CacheDiTParams":
        """The override of transformer ``name``: this one without ``secondary`` for
        ``transformer``; for ``transformer_2`` the ``secondary`` knobs over this one's (knobs as
        given: validation names them; a mounted context's key takes :meth:`canonical`)."""
        update = {"secondary": None}
        if name != "transformer" and self.secondary is not None:
            update.update(self.secondary.set_knobs())
        return self.model_copy(update=update)

    def canonical(self) -> "CacheDiTParams":
        """This override with what cache-dit would run anyway left unset, so that overrides that
        run the same are equal (one batch signature, one mounted context): knobs equal to
        cache-dit's defaults (``KNOB_DEFAULTS``), ``taylorseer_order`` without TaylorSeer,
        ``scm_preset: none``, ``scm_policy`` ``dynamic`` or without a mask, and ``secondary``
        knobs equal to what the primary's give ``transformer_2``. cache-dit reads its config by
        value (a warmup of 8 given or defaulted is the same), so the result runs the same."""
        first = _runs_as(self.set_knobs())
        primary = {k: v for k, v in first.items() if v != KNOB_DEFAULTS[k]}
        secondary = None
        if self.secondary is not None:
            second = _runs_as({**self.set_knobs(), **self.secondary.set_knobs()})  # the primary's as given
            ignored = set() if second["enable_taylorseer"] else {"taylorseer_order"}
            secondary = {k: v for k, v in second.items() if v != first[k] and k not in ignored} or None
        policy = self.scm_policy if self.has_mask and self.scm_policy != "dynamic" else None
        return CacheDiTParams.model_validate({
            **{k: None for k in CacheDiTKnobs.model_fields}, **primary, "secondary": secondary,
            "scm_preset": None if self.scm_preset == "none" else self.scm_preset,
            "scm_compute_bins": self.scm_compute_bins, "scm_cache_bins": self.scm_cache_bins, "scm_policy": policy})

    def describe(self) -> str:
        """Compact text for signatures and logs: the keys that are set, e.g. ``{Fn_compute_blocks: 1}``."""
        parts = [f"{k}: {v}" for k, v in self.model_dump(exclude_none=True).items()]
        return "{" + ", ".join(parts) + "}"
