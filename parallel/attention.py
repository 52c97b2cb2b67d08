"""Attention over a sequence sharded across ranks, through yunchang's LongContextAttention.

Kernels: on CUDA each request name runs the yunchang ``AttnType`` of its ``parallel.kernels``
entry (the default: ``torch_sdpa``'s). On CPU ``torch_sdpa`` (the default) runs PyTorch's SDPA
kernel for CPU (:func:`cpu_sdpa_attention`, the one a single-rank replica's
``F.scaled_dot_product_attention`` runs) and ``torch_math`` PyTorch math attention; no other
kernel runs on CPU (requests and configs naming one are refused before this).

Ring attention merges each rank's partial result by its log-sum-exp (LSE), which must be the
exact float32 LSE of the real queries (:func:`usp_kernel` decides per kernel):

- flash-attn returns one (``ring_lse="exact"``): yunchang's FA kernel is used as it is;
- torch's memory-efficient SDPA (yunchang's TORCH_EFFICIENT) returns its LSE padded to a
  multiple of 32 queries on CUDA, and yunchang casts it to the inputs' dtype (bf16): the
  merge then fails to broadcast whenever the per-rank sequence is not a multiple of 32, and
  merges a rounded LSE when it is. ditserve calls the kernel itself
  (:func:`efficient_attention_lse`) and slices and upcasts the LSE (:func:`exact_lse`);
- yunchang's TORCH_MATH returns a zero LSE: ditserve's :func:`lse_math_attention` computes
  the real one (on CPU every ring layout runs it).

The callables reach yunchang through its ``attn_processor`` hook (``compat.yunchang``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compat import torch as torch_compat
from compat import yunchang as compat
from parallel.kernels import KERNELS

DEFAULT_KERNEL = "torch_sdpa"  # what a layer without an override runs under sequence parallelism
LSE_ALIGNMENT = 32  # queries the CUDA memory-efficient kernel pads its LSE to (PyTorch's kAlignLSE)


def exact_lse(lse: torch.Tensor, num_queries: int) -> torch.Tensor:
    """A kernel's log-sum-exp as ring merges need it: (B, H, S_padded) of any float dtype →
    (B, H, ``num_queries``) float32, the rows of the real queries. PyTorch's CUDA
    memory-efficient attention returns ``ceil(S / 32) · 32`` rows (``kAlignLSE`` in
    ``aten/src/ATen/native/transformers/cuda/attention.cu``); the padding rows hold no LSE."""
    return lse[..., :num_queries].float()


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


def cpu_sdpa_attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, return_softmax=False, **_):
    """PyTorch's SDPA on CPU with the LSE ring merges need, as yunchang's ``(out, lse)``.

    q, k, v: (B, S, H, D) float32/bfloat16/float16 on CPU; returns out (B, S, H, D) in q's
    dtype and lse (B, H, S) float32. It is the kernel ``F.scaled_dot_product_attention`` runs
    on CPU for unmasked inputs (``compat.torch.cpu_flash_attention``), so ``torch_sdpa`` under
    sequence parallelism runs what it runs on one rank (it ran math attention, reported as
    ``torch_sdpa``).
    """
    out, lse = torch_compat.cpu_flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                dropout_p, causal, softmax_scale)
    return out.transpose(1, 2), lse


def efficient_attention_lse(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, return_softmax=False, **_):
    """PyTorch's memory-efficient SDPA (CUDA) with the LSE ring merges need.

    q, k, v: (B, S, H, D) float16/bfloat16 on CUDA; returns out (B, S, H, D) in q's dtype and
    lse (B, H, S) float32 (:func:`exact_lse` of the kernel's padded LSE).
    """
    out, lse = torch_compat.efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                dropout_p, causal, softmax_scale)
    return out.transpose(1, 2), exact_lse(lse, q.shape[1])


# ring_lse of a kernel -> the callable that gives ring attention its exact LSE on CUDA
RING_PROCESSORS: dict[str, Callable] = {"padded": efficient_attention_lse, "computed": lse_math_attention}


def usp_kernel(name: str | None, device_type: str, ring_degree: int) -> tuple[str | None, Callable | None]:
    """How kernel ``name`` (None: the default) runs under yunchang: ``(AttnType name, None)``
    or ``(None, attn_processor)``. Raises ``ValueError`` for a kernel that cannot give a ring
    layout its LSE (startup and request checks refuse it before this is reached)."""
    spec = KERNELS[name or DEFAULT_KERNEL]
    if device_type != "cuda":
        if spec.name == "torch_sdpa":
            return None, cpu_sdpa_attention
        if spec.name != "torch_math":
            raise ValueError(f"{spec.name} cannot run on {device_type}")
        return ("TORCH_MATH", None) if ring_degree == 1 else (None, lse_math_attention)
    if ring_degree == 1 or spec.ring_lse == "exact":
        return spec.yunchang, None
    if spec.ring_lse not in RING_PROCESSORS:
        raise ValueError(f"{spec.name} gives ring attention no log-sum-exp (ring_degree={ring_degree})")
    return None, RING_PROCESSORS[spec.ring_lse]


class USPAttention:
    """One yunchang ``LongContextAttention`` per kernel, built on first use (after the groups exist)."""

    def __init__(self, device_type: str, ring_degree: int):
        self.device_type = device_type
        self.ring_degree = ring_degree
        self._layers: dict = {}

    def _layer(self, name: str | None):
        attn_type, processor = usp_kernel(name, self.device_type, self.ring_degree)
        key = attn_type or processor.__name__
        if key not in self._layers:
            self._layers[key] = compat.long_context_attention(attn_type, attn_processor=processor)
        return self._layers[key]

    def __call__(self, query, key, value, kernel: str | None = None, softmax_scale: float | None = None):
        """(B, S/N, H, D) shards → attention over the full sequence, (B, S/N, H, D).
        ``softmax_scale``: None for D ** -0.5."""
        return self._layer(kernel)(query, key, value, softmax_scale=softmax_scale)


MASK_HEAD_PAD = 8  # head-dim channels masked_usp_attention adds (kernels want head dims in multiples of 8)
MASK_BIAS = 1e4  # the score a masked key loses: exp(-1e4) is 0 in every float format


def masked_usp_attention(usp: USPAttention, query, key, value, key_mask, kernel: str | None = None):
    """Attention over sequence shards whose keys carry a padding mask, through any yunchang
    layout (Ulysses, ring, or both): the mask rides in the keys themselves. Every head gets
    ``MASK_HEAD_PAD`` channels: the query's first is ``c``, a masked key's is ``-c``, a real
    key's 0, the values' 0, with ``c = sqrt(MASK_BIAS / scale)``, so a masked key's score drops
    by ``MASK_BIAS`` (its softmax weight and its share of the log-sum-exp become exactly 0)
    and a real key's is unchanged; the padding channels of the output are dropped. The keys'
    channels travel with the keys through every all-to-all and ring hop, which is what lets a
    ring layout mask keys other ranks hold (yunchang's ring merges take no mask).
    Costs ``MASK_HEAD_PAD / D`` more attention FLOPs.

    query, key, value: (B, S/N, H, D) local shards; key_mask: (B, S/N) bool, True on this
    rank's real keys (None: every key is real). Returns (B, S/N, H, D) in query's dtype.
    """
    if key_mask is None:
        return usp(query, key, value, kernel=kernel)
    head_dim = query.shape[-1]
    scale = head_dim ** -0.5
    c = (MASK_BIAS / scale) ** 0.5
    shape = (*query.shape[:-1], MASK_HEAD_PAD)
    q_pad = torch.zeros(shape, dtype=query.dtype, device=query.device)
    q_pad[..., 0] = c
    k_pad = torch.zeros((*key.shape[:-1], MASK_HEAD_PAD), dtype=key.dtype, device=key.device)
    k_pad[..., 0] = torch.where(key_mask.bool(), 0.0, -c).to(key.dtype)[:, :, None]
    v_pad = torch.zeros((*value.shape[:-1], MASK_HEAD_PAD), dtype=value.dtype, device=value.device)
    out = usp(torch.cat([query, q_pad], -1), torch.cat([key, k_pad], -1), torch.cat([value, v_pad], -1),
              kernel=kernel, softmax_scale=scale)
    return out[..., :head_dim]


def masked_ulysses_attention(query, key, value, key_mask, backend=None, mask_is_whole: bool = False):
    """Ulysses attention over shards whose keys carry a padding mask (Qwen-Image's text, Z-Image's
    padded samples), which yunchang's LongContextAttention cannot take: yunchang's all-to-all
    gathers the sequence and scatters the heads, every rank all-gathers the key mask in the same
    rank order (unless ``mask_is_whole``: every rank already holds it), attention runs through
    diffusers' dispatcher with the mask (``backend``: the layer's kernel), and the inverse
    all-to-all restores the shards.

    query, key, value: (B, S/N, H, D) local shards; key_mask: (B, S/N) bool, True on real keys
    ((B, S) with ``mask_is_whole``; None: every key is real). Returns (B, S/N, H, D). Ring
    degree 1 only (ring merges carry no mask).
    """
    import torch.distributed as dist
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    group = compat.ulysses_group()
    world = dist.get_world_size(group)
    gathered = compat.seq_all_to_all(group, torch.stack([query, key, value]).flatten(0, 1), scatter_idx=2,
                                     gather_idx=1)
    q, k, v = gathered.unflatten(0, (3, query.shape[0])).unbind(0)
    if key_mask is None or mask_is_whole:
        mask = None if key_mask is None else key_mask.bool()[:, None, None, :]
    else:
        pieces = [torch.empty_like(key_mask, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(pieces, key_mask.to(torch.uint8), group=group)
        mask = torch.cat(pieces, dim=1).bool()[:, None, None, :]  # (B, 1, 1, S): keys of every rank, rank order
    out = dispatch_attention_fn(q, k, v, attn_mask=mask, backend=backend)
    return compat.seq_all_to_all(group, out.contiguous(), scatter_idx=1, gather_idx=2)
