"""cache-dit's private APIs that ditserve uses, in one place (tested range: ``TESTED``).

A mounted transformer carries cache-dit's context manager as the instance attribute
``_context_manager``; its contexts live in ``_cached_context_manager``. ditserve reads them to
tell whether a transformer is mounted, to read the live context config (tests), and to advance
a separate-CFG context's call parity when CFG gating skips a guiding forward.

On several ranks cache-dit averages its cache decision's statistic with
``torch.distributed.all_reduce`` over the default group (every rank of the replica), through
the module global ``dist`` of ``cache_manager``. Under CFG parallelism that mixed the two
branches into one decision; :func:`reduce_decisions_over` points it at the rank's
sequence-parallel group instead.
"""

from __future__ import annotations

import functools

from compat import CompatError, Reliance, missing

DISTRIBUTION = "cache-dit"
TESTED = ">=1.5.3,<1.6"

RELIES_ON = (
    Reliance("cache_dit.caching.cache_contexts.cache_manager", "CachedContextManager", "per-transformer contexts"),
    Reliance("cache_dit.caching.cache_contexts.cache_context", "CachedContext.mark_step_begin",
             "advancing a context one call"),
    Reliance("cache_dit.caching.cache_contexts.cache_context", "CachedContext", "context configs"),
    Reliance("cache_dit.caching.cache_contexts.cache_manager", "dist", "the group cache decisions are reduced over"),
)


def check() -> list[str]:
    """What the installed cache-dit lacks of :data:`RELIES_ON` (empty: nothing)."""
    return missing(DISTRIBUTION, TESTED, RELIES_ON)


def is_mounted(transformer) -> bool:
    """Whether cache-dit's hooks are on ``transformer`` (its context manager is attached)."""
    return getattr(transformer, "_context_manager", None) is not None


def contexts(transformer) -> list:
    """cache-dit's ``CachedContext`` objects of a mounted transformer (empty when unmounted).
    Raises :class:`CompatError` when the context manager has no ``_cached_context_manager``."""
    manager = getattr(transformer, "_context_manager", None)
    if manager is None:
        return []
    try:
        return list(manager._cached_context_manager.values())
    except AttributeError as exc:
        raise CompatError(f"cache-dit's context manager no longer has _cached_context_manager ({exc}); "
                          f"ditserve is tested with cache-dit{TESTED}") from None


def disable_cache(transformer) -> None:
    """``cache_dit.disable_cache(transformer)``, also where the forward cache-dit saved when it
    mounted is a ``functools.partial``: diffusers' hook registry makes a module's ``forward``
    one (group offloading's hooks on a Wan transformer), and cache-dit 1.5 restores the saved
    forward with ``__get__``, which a partial lacks before Python 3.13 and binds as a method
    from 3.14 (``AttributeError``; helper-67: every
    unmount and remount failed its batch). Such a forward is put back as it was, an instance
    attribute, before cache-dit releases the rest."""
    import cache_dit

    original = getattr(transformer, "_original_forward", None)
    if isinstance(original, functools.partial):  # not by a missing __get__: Python 3.13 gave partial one
        transformer.forward = original
        del transformer._original_forward
    cache_dit.disable_cache(transformer)


def advance_one_call(transformer) -> None:
    """Advance every context of ``transformer`` by one call (``mark_step_begin``): a
    separate-CFG context tells the conditional and guiding calls apart by parity. Raises
    :class:`CompatError` as :func:`contexts`."""
    for context in contexts(transformer):
        context.mark_step_begin()


class _GroupDistributed:
    """``torch.distributed`` as cache-dit's ``cache_manager`` calls it, with ``all_reduce``
    over ``group`` where the caller names none (nothing to do on a group of one rank)."""

    def __init__(self, group, size: int):
        self._group = group
        self._size = size

    def __getattr__(self, name):
        import torch.distributed

        return getattr(torch.distributed, name)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        import torch.distributed

        if group is None and self._size == 1:
            return None
        op = torch.distributed.ReduceOp.SUM if op is None else op
        return torch.distributed.all_reduce(tensor, op=op, group=group or self._group, async_op=async_op)


def reduce_decisions_over(group, size: int) -> None:
    """Make cache-dit reduce its cache decision's statistic over ``group`` (``size`` ranks: a
    replica rank's sequence-parallel group, DESIGN "Acceleration state") instead of every rank
    of the process group. Process-wide (one replica rank per process). Under CFG parallelism
    each CFG group then decides for its own branch, as one rank decides each branch
    (``enable_separate_cfg``); the ranks sharing a sequence still decide together. Raises
    :class:`CompatError` when cache-dit's ``cache_manager`` module is gone."""
    try:
        from cache_dit.caching.cache_contexts import cache_manager
    except ImportError as exc:
        raise CompatError(f"cache-dit's cache_manager module is gone ({exc}); ditserve is tested with "
                          f"cache-dit{TESTED}") from None
    cache_manager.dist = _GroupDistributed(group, size)
