"""torch internals ditserve relies on beyond its public API (tested range: ``TESTED``).

- Dynamo's counters (``torch._dynamo.utils.counters``): graphs compiled, and frames that hit
  the recompile limit. Past ``torch._dynamo.config.recompile_limit`` (8 by default) dynamo
  runs a function uncompiled and only logs a warning; ditserve counts those in ``/v1/stats``.
- The CUDA memory-efficient SDPA op (``torch.ops.aten._scaled_dot_product_efficient_attention``)
  that returns the log-sum-exp ring attention merges by (``parallel.attention``), and the CPU
  flash SDPA op (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``), the kernel
  ``F.scaled_dot_product_attention`` runs on CPU for unmasked inputs, which returns it too.
"""

from __future__ import annotations

from compat import Reliance, missing

DISTRIBUTION = "torch"
TESTED = ">=2.13,<2.15"

# dynamo's graph-break type when a frame exceeds the recompile limit (its counters key starts with it)
RECOMPILE_LIMIT_BREAK = "Dynamo recompile limit exceeded"

RELIES_ON = (
    Reliance("torch._dynamo.utils", "counters", "graphs compiled and recompile-limit hits"),
    Reliance("torch._dynamo.config", "recompile_limit", "the recompile limit"),
    Reliance("torch", "ops.aten._scaled_dot_product_efficient_attention", "the LSE of torch's efficient SDPA"),
    Reliance("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu", "the LSE of torch's SDPA on CPU"),
)


def check() -> list[str]:
    """What the installed torch lacks of :data:`RELIES_ON` (empty: nothing)."""
    return missing(DISTRIBUTION, TESTED, RELIES_ON)


def dynamo_counts() -> dict[str, int]:
    """This process's dynamo record: ``compiled_graphs`` (graphs dynamo has compiled, first
    compiles and recompiles), ``recompile_limit_hits`` (frames dynamo gave up on and runs
    uncompiled) and ``recompile_limit`` (the current limit per code object)."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.utils import counters

    hits = sum(n for key, n in counters["unimplemented"].items() if key.startswith(RECOMPILE_LIMIT_BREAK))
    return {"compiled_graphs": int(counters["stats"]["unique_graphs"]), "recompile_limit_hits": int(hits),
            "recompile_limit": int(dynamo_config.recompile_limit)}


def efficient_attention(q, k, v, dropout_p: float = 0.0, causal: bool = False, scale: float | None = None):
    """torch's memory-efficient SDPA (CUDA only) with its log-sum-exp: q, k, v (B, H, S, D) →
    (out (B, H, S, D), lse (B, H, S padded to a multiple of 32) float32)."""
    import torch

    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, dropout_p, causal, scale=scale)[:2]
    return out, lse


def cpu_flash_attention(q, k, v, dropout_p: float = 0.0, causal: bool = False, scale: float | None = None):
    """torch's SDPA on CPU (its flash kernel: what ``F.scaled_dot_product_attention`` runs there
    for unmasked inputs) with its log-sum-exp: q, k, v (B, H, S, D) float32/bfloat16/float16 on
    CPU → (out (B, H, S, D) in q's dtype, lse (B, H, S) float32). Inputs whose last dimension is
    strided are copied first: the op reads them as if it were not (F.sdpa checks; the op does not)."""
    import torch

    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, causal, scale=scale)[:2]
    return out, lse
