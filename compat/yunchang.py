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
    with ``attn_processor`` (a callable ``(q, k, v, ...) -> (out, lse)``) when ``attn_type`` is None."""
    from yunchang import LongContextAttention
    from yunchang.kernels import AttnType

    if attn_type is not None:
        return LongContextAttention(attn_type=getattr(AttnType, attn_type))
    try:
        return LongContextAttention(attn_type=None, attn_processor=attn_processor)
    except TypeError as exc:
        raise CompatError(f"yunchang's LongContextAttention rejected attn_processor ({exc}); ditserve is "
                          f"tested with yunchang{TESTED}") from None
