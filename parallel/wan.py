"""Sequence parallelism for Wan transformers (``WanTransformer3DModel``).

Video tokens (latent frames × patches, flattened) and their rotary tables are split along
the sequence by diffusers' hooks from the model's ``_cp_plan``; text tokens are not split.
Self-attention runs through yunchang's LongContextAttention over the shards; cross-attention
needs no communication (each rank's query shard attends to all text tokens).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from compat import diffusers as compat
from parallel.attention import USPAttention
from parallel.config import ParallelConfig
from parallel.kernels import kernel_for_backend
from parallel.sharding import apply_sequence_split


def _apply_rotary_emb(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor):
    """Wan's interleaved rotary embedding, as in diffusers' ``WanAttnProcessor``:
    hidden_states (B, S, H, D), freqs (1, S, 1, D)."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


class USPWanAttnProcessor(WanAttnProcessor):
    """WanAttnProcessor whose self-attention is yunchang's LongContextAttention over the shards.

    Keeps ``_attention_backend`` so per-request kernel switches reach yunchang's kernel map
    (self-attention) and diffusers' dispatcher (cross-attention).
    """

    def __init__(self, usp: USPAttention):
        super().__init__()
        self.usp = usp

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None:  # cross-attention: local query shard, all text tokens
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if attention_mask is not None:
            raise ValueError("sequence-parallel Wan self-attention takes no attention mask")
        query, key, value = compat.wan_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _apply_rotary_emb(query, *rotary_emb)
            key = _apply_rotary_emb(key, *rotary_emb)
        hidden_states = self.usp(query, key, value, kernel=kernel_for_backend(compat.get_processor_backend(self)))
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](hidden_states))


def enable_sequence_parallel(transformer: torch.nn.Module, config: ParallelConfig, mesh, rank: int) -> None:
    """Shard a Wan ``transformer``'s sequence across the mesh: yunchang self-attention in every
    block, diffusers' split/gather hooks from ``transformer._cp_plan``. Raises ``ValueError``
    when the transformer has no ``_cp_plan``."""
    usp = USPAttention(transformer.device.type, config.ring_degree)
    for module in transformer.modules():
        if isinstance(getattr(module, "processor", None), WanAttnProcessor):
            module.set_processor(USPWanAttnProcessor(usp))
    apply_sequence_split(transformer, config, mesh, rank)
