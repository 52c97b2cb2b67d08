"""Sequence parallelism for Z-Image transformers (``ZImageTransformer2DModel``): our own split hooks.

diffusers has no ``_cp_plan`` for Z-Image: its transformer refines the image and caption
tokens apart, then builds one padded "unified" sequence per sample inside ``forward``
(``_build_unified_sequence``: image tokens then caption tokens, each padded to a multiple of
32, a key mask when the samples' lengths differ) and runs its main ``layers`` over it. So the
split goes where that sequence is made: ``_build_unified_sequence``'s result is split along the
sequence across the sequence-parallel ranks (the hidden states and rotary table, in yunchang's
order: ring-major, Ulysses ranks contiguous), every main layer's attention runs through yunchang
with the key mask (Ulysses alone: :func:`parallel.attention.masked_ulysses_attention`, every
rank holding the whole mask; with a ring: :func:`parallel.attention.masked_usp_attention`, the
mask of each rank's own keys carried in the keys), and a forward pre-hook on the final layer
gathers the sequence back. Cache-DiT (which wraps the main layers) then only ever sees the
local shard, and its decision statistic is reduced over the ranks as for the other families.
The refiners before the split run whole on every rank (a few layers over the separate streams).

The unified length is a multiple of 32 (``SEQUENCE_MULTIPLE``), so it splits evenly across
``ulysses_degree x ring_degree`` ranks dividing 32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from compat import diffusers as compat
from compat import yunchang
from parallel.attention import USPAttention, masked_ulysses_attention, masked_usp_attention
from parallel.config import ParallelConfig
from parallel.kernels import kernel_for_backend

SEQUENCE_MULTIPLE = 32  # diffusers' SEQ_MULTI_OF: every unified sequence's length is a multiple of it


def _rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Z-Image's rotary embedding (``ZSingleStreamAttnProcessor``'s): x (B, S, H, D) real,
    freqs_cis (B, S, D/2) complex64 → (B, S, H, D) in x's dtype."""
    with torch.amp.autocast("cuda", enabled=False):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis.unsqueeze(2)).flatten(3).type_as(x)


class USPZSingleStreamAttnProcessor(ZSingleStreamAttnProcessor):
    """Z-Image's single-stream attention over the ranks' shards of the unified sequence, with
    the key mask. Keeps ``_attention_backend`` so per-request kernel switches reach the kernel."""

    def __init__(self, usp: USPAttention, split: _UnifiedSplit):
        super().__init__()
        self.usp, self.split = usp, split

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        """hidden_states: (B, S/N, C) this rank's shard; attention_mask: (B, S) bool over every
        rank's keys (or None); freqs_cis: (B, S/N, D/2) the shard's rotary table. Returns (B, S/N, C)."""
        query, key, value = (x.unflatten(-1, (attn.heads, -1)) for x in (
            attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if freqs_cis is not None:
            query, key = _rotary(query, freqs_cis), _rotary(key, freqs_cis)
        mask = None if attention_mask is None else attention_mask.reshape(attention_mask.shape[0], -1)
        if self.usp.ring_degree == 1:
            out = masked_ulysses_attention(query, key, value, mask, backend=compat.processor_backend(self),
                                           mask_is_whole=True)
        else:  # the keys carry their own (this shard's) mask through the ring
            local = None if mask is None else mask[:, self.split.window()]
            out = masked_usp_attention(self.usp, query, key, value, local,
                                       kernel=kernel_for_backend(compat.get_processor_backend(self)))
        output = attn.to_out[0](out.flatten(2, 3).to(query.dtype))
        return attn.to_out[1](output) if len(attn.to_out) > 1 else output


class _UnifiedSplit:
    """Splits what ``_build_unified_sequence`` returns across the sequence-parallel ranks (shard
    ``ring_rank x ulysses_degree + ulysses_rank``, yunchang's order) and gathers the main
    layers' output before the final layer (within each Ulysses group, then across the ring)."""

    def __init__(self, transformer: torch.nn.Module, config: ParallelConfig):
        self.ulysses = yunchang.ulysses_group()
        self.ring = yunchang.ring_group() if config.ring_degree > 1 else None
        self.world = config.ulysses_degree * config.ring_degree
        ring_rank = dist.get_rank(self.ring) if self.ring is not None else 0
        self.rank = ring_rank * config.ulysses_degree + dist.get_rank(self.ulysses)
        self.build = transformer._build_unified_sequence  # the bound original
        self.length: int | None = None  # the whole unified length of the running forward

    def window(self) -> slice:
        """This rank's tokens of the running forward's unified sequence."""
        local = self.length // self.world
        return slice(self.rank * local, (self.rank + 1) * local)

    def split(self, *args, **kwargs):
        unified, freqs, mask, noise = self.build(*args, **kwargs)
        self.length = unified.shape[1]
        if self.length % self.world:
            raise ValueError(f"Z-Image's unified sequence has {self.length} tokens, not divisible by the "
                             f"{self.world} sequence-parallel ranks")
        window = self.window()
        noise = None if noise is None else noise[:, window]
        return unified[:, window].contiguous(), freqs[:, window].contiguous(), mask, noise

    def gather(self, _module, args, kwargs):
        unified = args[0]
        if self.length is None or unified.shape[1] == self.length:
            return None
        for group in (self.ulysses, self.ring):  # Ulysses ranks hold neighbouring shards; rings, blocks of them
            if group is None or dist.get_world_size(group) == 1:
                continue
            pieces = [torch.empty_like(unified) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, unified.contiguous(), group=group)
            unified = torch.cat(pieces, dim=1)
        return (unified, *args[1:]), kwargs


def enable_sequence_parallel(transformer: torch.nn.Module, config: ParallelConfig, mesh, rank: int) -> None:
    """Shard a Z-Image ``transformer``'s unified sequence across the sequence-parallel ranks (see
    the module docstring). Raises ``ValueError`` when ``ulysses_degree x ring_degree`` does not
    divide 32."""
    if SEQUENCE_MULTIPLE % (config.ulysses_degree * config.ring_degree):
        raise ValueError(f"Z-Image's unified sequence is a multiple of {SEQUENCE_MULTIPLE} tokens: ulysses_degree x "
                         f"ring_degree must divide it (got {config.ulysses_degree} x {config.ring_degree})")
    split = _UnifiedSplit(transformer, config)
    usp = USPAttention(transformer.device.type, config.ring_degree)
    for module in transformer.layers.modules():  # the main layers only: the refiners run whole on every rank
        if isinstance(getattr(module, "processor", None), ZSingleStreamAttnProcessor):
            module.set_processor(USPZSingleStreamAttnProcessor(usp, split))
    compat.replace_z_image_unified_sequence(transformer, split.split)
    for final in transformer.all_final_layer.values():
        final.register_forward_pre_hook(split.gather, with_kwargs=True)
