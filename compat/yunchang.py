"""yunchang behaviour ditserve relies on beyond its documented API (tested range: ``TESTED``).

Ring attention needs a kernel returning an exact log-sum-exp. On CPU none of yunchang's
``AttnType`` kernels does (``TORCH_MATH`` returns zeros), so ditserve passes its own through
``LongContextAttention(attn_processor=...)`` with ``attn_type=None``: yunchang's kernel selector
then reaches its ``attn_processor`` branch, which no ``AttnType`` value does.
"""

from __future__ import annotations

import inspect

from compat import CompatError, Reliance, missing

DISTRIBUTION = "yunchang"
TESTED = ">=0.6.4,<0.7"

RELIES_ON = (
    Reliance("yunchang", "LongContextAttention", "Ulysses/ring attention"),
    Reliance("yunchang", "set_seq_parallel_pg", "Ulysses/ring process groups"),
    Reliance("yunchang.kernels", "AttnType", "kernel names"),
    Reliance("yunchang.kernels", "select_flash_attn_impl", "the attn_processor branch"),
    Reliance("yunchang.comm.all_to_all", "SeqAllToAll4D", "masked Ulysses attention (Qwen-Image text masks)"),
    Reliance("yunchang.globals", "PROCESS_GROUP", "the Ulysses process group"),
)


def check() -> list[str]:
    """What the installed yunchang lacks (empty: nothing), including the ``attn_processor``
    parameter of ``LongContextAttention`` and of its kernel selector."""
    problems = missing(DISTRIBUTION, TESTED, RELIES_ON)
    if not problems:
        from yunchang import LongContextAttention
        from yunchang.kernels import select_flash_attn_impl

        for fn in (LongContextAttention.__init__, select_flash_attn_impl):
            if "attn_processor" not in inspect.signature(fn).parameters:
                problems.append(f"yunchang's {fn.__qualname__} no longer takes attn_processor; ditserve is "
                                f"tested with yunchang{TESTED}")
    return problems


def long_context_attention(attn_type: str | None, attn_processor=None):
    """yunchang's ``LongContextAttention`` with kernel ``attn_type`` (an ``AttnType`` name), or
    with ``attn_processor`` (a callable ``(q, k, v, ...) -> (out, lse)``) when ``attn_type`` is None.
    Raises :class:`CompatError` when ``LongContextAttention`` rejects ``attn_processor``."""
    from yunchang import LongContextAttention
    from yunchang.kernels import AttnType

    if attn_type is not None:
        return LongContextAttention(attn_type=getattr(AttnType, attn_type))
    try:
        return LongContextAttention(attn_type=None, attn_processor=attn_processor)
    except TypeError as exc:
        raise CompatError(f"yunchang's LongContextAttention rejected attn_processor ({exc}); ditserve is "
                          f"tested with yunchang{TESTED}") from None


def ulysses_group():
    """The Ulysses process group ``set_seq_parallel_pg`` made (``yunchang.globals.PROCESS_GROUP``)."""
    from yunchang.globals import PROCESS_GROUP

    return PROCESS_GROUP.ULYSSES_PG


def ring_group():
    """The ring process group ``set_seq_parallel_pg`` made (``yunchang.globals.PROCESS_GROUP``)."""
    from yunchang.globals import PROCESS_GROUP

    return PROCESS_GROUP.RING_PG


def seq_all_to_all(group, x, scatter_idx: int, gather_idx: int):
    """yunchang's 4-D all-to-all: (B, S/N, H, D) → (B, S, H/N, D) with ``scatter_idx=2,
    gather_idx=1``, and back with ``scatter_idx=1, gather_idx=2``."""
    from yunchang.comm.all_to_all import SeqAllToAll4D

    return SeqAllToAll4D.apply(group, x, scatter_idx, gather_idx)
