"""Sequence parallelism for FLUX.1 transformers.

Inputs are split and the output gathered by diffusers' own context-parallel hooks, which
read the model's ``_cp_plan`` (image tokens, text tokens and both rotary-id tables split
along the sequence; ``proj_out`` gathered). Attention runs through yunchang, not
diffusers' built-in context-parallel attention: each attention processor is replaced by
:class:`USPFluxAttnProcessor`.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from compat import diffusers as compat
from parallel.attention import USPAttention
from parallel.config import ParallelConfig
from parallel.kernels import kernel_for_backend
from parallel.sharding import apply_sequence_split


class USPFluxAttnProcessor(FluxAttnProcessor):
    """FluxAttnProcessor whose attention is yunchang's LongContextAttention over the shards.

    Keeps ``_attention_backend`` so per-request kernel switches reach yunchang's kernel map.
    Raises ``ValueError`` when called with an ``attention_mask``.
    """

    def __init__(self, usp: USPAttention):
        super().__init__()
        self.usp = usp

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if attention_mask is not None:
            raise ValueError("sequence-parallel FLUX attention takes no attention mask")
        query, key, value, encoder_query, encoder_key, encoder_value = compat.flux_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if attn.added_kv_proj_dim is not None:
            query = torch.cat([attn.norm_added_q(encoder_query.unflatten(-1, (-1, attn.head_dim))), query], dim=1)
            key = torch.cat([attn.norm_added_k(encoder_key.unflatten(-1, (-1, attn.head_dim))), key], dim=1)
            value = torch.cat([encoder_value.unflatten(-1, (-1, attn.head_dim)), value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        hidden_states = self.usp(query, key, value, kernel=kernel_for_backend(compat.get_processor_backend(self)))
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return hidden_states
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states


def enable_sequence_parallel(transformer: torch.nn.Module, config: ParallelConfig, mesh, rank: int) -> None:
    """Shard a FLUX.1 ``transformer``'s sequence across the mesh: yunchang attention in every
    attention layer, diffusers' split/gather hooks from its ``_cp_plan``. Raises ``ValueError``
    when the transformer has no ``_cp_plan``."""
    usp = USPAttention(transformer.device.type, config.ring_degree)
    for module in transformer.modules():
        if isinstance(getattr(module, "processor", None), FluxAttnProcessor):
            module.set_processor(USPFluxAttnProcessor(usp))
    apply_sequence_split(transformer, config, mesh, rank)
