"""cache-dit's private APIs that ditserve uses, in one place (tested range: ``TESTED``).

A mounted transformer carries cache-dit's context manager as the instance attribute
``_context_manager``; its contexts live in ``_cached_context_manager``. ditserve reads them to
tell whether a transformer is mounted, to read the live context config (tests), and to advance
a separate-CFG context's call parity when CFG gating skips a guiding forward.
"""

from __future__ import annotations

from compat import CompatError, Reliance, missing

DISTRIBUTION = "cache-dit"
TESTED = ">=1.5.3,<1.6"

RELIES_ON = (
    Reliance("cache_dit.caching.cache_contexts.cache_manager", "CachedContextManager", "per-transformer contexts"),
    Reliance("cache_dit.caching.cache_contexts.cache_context", "CachedContext.mark_step_begin",
             "advancing a context one call"),
    Reliance("cache_dit.caching.cache_contexts.cache_context", "CachedContext", "context configs"),
)


def check() -> list[str]:
    """What the installed cache-dit lacks of :data:`RELIES_ON` (empty: nothing)."""
    return missing(DISTRIBUTION, TESTED, RELIES_ON)


def is_mounted(transformer) -> bool:
    """Whether cache-dit's hooks are on ``transformer`` (its context manager is attached)."""
    return getattr(transformer, "_context_manager", None) is not None


def contexts(transformer) -> list:
    """cache-dit's ``CachedContext`` objects of a mounted transformer (empty when unmounted)."""
    manager = getattr(transformer, "_context_manager", None)
    if manager is None:
        return []
    try:
        return list(manager._cached_context_manager.values())
    except AttributeError as exc:
        raise CompatError(f"cache-dit's context manager no longer has _cached_context_manager ({exc}); "
                          f"ditserve is tested with cache-dit{TESTED}") from None


def advance_one_call(transformer) -> None:
    """Advance every context of ``transformer`` by one call (``mark_step_begin``): a
    separate-CFG context tells the conditional and guiding calls apart by parity."""
    for context in contexts(transformer):
        context.mark_step_begin()
