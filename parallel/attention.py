"""Attention over a sequence sharded across ranks, through yunchang's LongContextAttention.

Kernels: on CUDA each request name runs the yunchang ``AttnType`` of its ``parallel.kernels``
entry (the default: ``torch_sdpa``'s). On CPU every name runs PyTorch math attention. yunchang's TORCH_MATH returns a zero log-sum-exp,
which is only right with ``ring_degree == 1``; for ring attention ditserve passes yunchang
:func:`lse_math_attention` through its ``attn_processor`` hook, an exact kernel that returns
the real log-sum-exp, so ring parallelism is correct (and tested) on CPU.
"""

from __future__ import annotations

import torch

from compat import yunchang as compat
from parallel.kernels import KERNELS

DEFAULT_KERNEL = "torch_sdpa"  # what a layer without an override runs under sequence parallelism


def lse_math_attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, return_softmax=False, **_):
    """Exact attention returning yunchang's ``(out, lse)`` pair.

    q, k, v: (B, S, H, D); returns out (B, S, H, D) in q's dtype and lse (B, H, S) float32.
    Raises ``ValueError`` for causal attention (DiTs attend bidirectionally).
    """
    if causal:
        raise ValueError("lse_math_attention is bidirectional only")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    qh, kh, vh = (x.transpose(1, 2).float() for x in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), vh)
    return out.transpose(1, 2).to(q.dtype), lse


class USPAttention:
    """One yunchang ``LongContextAttention`` per kernel, built on first use (after the groups exist)."""

    def __init__(self, device_type: str, ring_degree: int):
        self.device_type = device_type
        self.ring_degree = ring_degree
        self._layers: dict = {}

    def _layer(self, name: str | None):
        key = name if self.device_type == "cuda" else "cpu"
        if key not in self._layers:
            if self.device_type == "cuda" and not (name == "torch_math" and self.ring_degree > 1):
                layer = compat.long_context_attention(KERNELS[name or DEFAULT_KERNEL].yunchang)
            elif self.ring_degree == 1:
                layer = compat.long_context_attention("TORCH_MATH")
            else:  # exact log-sum-exp for ring merges (compat.yunchang says how it reaches yunchang)
                layer = compat.long_context_attention(None, attn_processor=lse_math_attention)
            self._layers[key] = layer
        return self._layers[key]

    def __call__(self, query, key, value, kernel: str | None = None):
        """(B, S/N, H, D) shards → attention over the full sequence, (B, S/N, H, D)."""
        return self._layer(kernel)(query, key, value)
