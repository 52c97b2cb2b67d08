"""Per-request acceleration fields: the Cache-DiT override whitelist and its frozen key.

The knob names are cache-dit's own (``DBCacheConfig``: ``Fn_compute_blocks``,
``Bn_compute_blocks``, ``max_warmup_steps``, ``residual_diff_threshold``,
``max_continuous_cached_steps``; ``TaylorSeerCalibratorConfig``: ``taylorseer_order``),
and the step-computation-mask keys follow cache-dit's ``steps_mask`` helper
(``mask_policy`` presets ``slow | medium | fast | ultra``, explicit ``compute_bins`` /
``cache_bins``; see cache-dit's README, "Steps Computation Masking").
"""

from __future__ import annotations

from typing import Any

# name -> (type, lower bound inclusive or None, description of allowed values)
CACHE_DIT_KNOBS: dict[str, tuple[type, float | None, str]] = {
    "Fn_compute_blocks": (int, 1, "an integer >= 1"),
    "Bn_compute_blocks": (int, 0, "an integer >= 0"),
    "max_warmup_steps": (int, 0, "an integer >= 0"),
    "residual_diff_threshold": (float, 0.0, "a number > 0"),
    "max_continuous_cached_steps": (int, -1, "an integer >= -1 (-1: unlimited)"),
    "enable_taylorseer": (bool, None, "true or false"),
    "taylorseer_order": (int, 1, "an integer >= 1"),
}
SCM_PRESETS = ("none", "slow", "medium", "fast", "ultra")
SCM_POLICIES = ("dynamic", "static")
SCM_KEYS = ("scm_preset", "scm_compute_bins", "scm_cache_bins", "scm_policy")
SECONDARY = "secondary"
CACHE_DIT_KEYS = (*CACHE_DIT_KNOBS, *SCM_KEYS, SECONDARY)

# Request-switchable dense attention backends. ``torch_math`` is PyTorch's exact math SDPA,
# the CPU-capable kernel; the others need CUDA and their packages (see issue 4).
ATTENTION_BACKENDS = ("fa", "torch_sdpa", "sage_attn", "sage_attn_3", "torch_math")


def _check_knob(path: str, key: str, value: Any) -> str | None:
    kind, low, allowed = CACHE_DIT_KNOBS[key]
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    else:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and value == value and value > low and value != float("inf"))
    return None if ok else f"{path}.{key} must be {allowed}, got {value!r}"


def _check_bins(path: str, key: str, value: Any) -> str | None:
    if (isinstance(value, list) and value
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        return None
    return f"{path}.{key} must be a non-empty list of integers >= 1, got {value!r}"


def validate_cache_dit_params(params: dict, path: str = "cache_dit_params") -> list[str]:
    """Return every problem of a ``cache_dit_params`` override (empty list: valid).

    Unknown keys, wrong types, out-of-range values, ``scm_compute_bins`` without
    ``scm_cache_bins`` (or the reverse), a ``secondary`` that is not a dict or that
    holds anything but knob keys.
    """
    problems: list[str] = []
    for key, value in params.items():
        if key in CACHE_DIT_KNOBS:
            problems.append(_check_knob(path, key, value))
        elif key == "scm_preset":
            if value not in SCM_PRESETS:
                problems.append(f"{path}.scm_preset must be one of {', '.join(SCM_PRESETS)}, got {value!r}")
        elif key == "scm_policy":
            if value not in SCM_POLICIES:
                problems.append(f"{path}.scm_policy must be one of {', '.join(SCM_POLICIES)}, got {value!r}")
        elif key in ("scm_compute_bins", "scm_cache_bins"):
            problems.append(_check_bins(path, key, value))
        elif key == SECONDARY and path == "cache_dit_params":
            if not isinstance(value, dict):
                problems.append(f"{path}.secondary must be an object of cache knobs, got {value!r}")
                continue
            for sub_key, sub_value in value.items():
                if sub_key in CACHE_DIT_KNOBS:
                    problems.append(_check_knob(f"{path}.secondary", sub_key, sub_value))
                else:
                    problems.append(
                        f"{path}.secondary has unknown key {sub_key!r}; allowed: {', '.join(CACHE_DIT_KNOBS)}")
        else:
            allowed = CACHE_DIT_KEYS if path == "cache_dit_params" else CACHE_DIT_KNOBS
            problems.append(f"{path} has unknown key {key!r}; allowed: {', '.join(allowed)}")
    if ("scm_compute_bins" in params) != ("scm_cache_bins" in params):
        problems.append(f"{path}: scm_compute_bins and scm_cache_bins must be given together")
    if "scm_compute_bins" in params and params.get("scm_preset") not in (None, "none"):
        problems.append(f"{path}: give either scm_preset or scm_compute_bins/scm_cache_bins, not both")
    return [p for p in problems if p]


def freeze_cache_dit_params(params: dict | None) -> tuple | None:
    """A hashable, order-insensitive key of a validated override (nested ``secondary`` too)."""
    if params is None:
        return None

    def freeze(value):
        if isinstance(value, dict):
            return tuple(sorted((k, freeze(v)) for k, v in value.items()))
        if isinstance(value, list):
            return tuple(value)
        return value

    return tuple(sorted((k, freeze(v)) for k, v in params.items()))
