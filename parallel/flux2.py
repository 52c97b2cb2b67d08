"""Sequence parallelism for FLUX.2 transformers (``Flux2Transformer2DModel``).

Inputs are split and the output gathered by diffusers' own context-parallel hooks, which read
the model's ``_cp_plan`` (image and text tokens and both 4-axis id tables split along the
sequence at the model's entry; ``proj_out`` gathered). Attention runs through yunchang: the
double-stream blocks' ``Flux2AttnProcessor`` and the single-stream blocks'
``Flux2ParallelSelfAttnProcessor`` are replaced by subclasses whose attention is
:class:`parallel.attention.USPAttention`; projections, norms and rotary embedding are
diffusers' own.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor

from compat import diffusers as compat
from parallel.attention import USPAttention
from parallel.config import ParallelConfig
from parallel.kernels import kernel_for_backend
from parallel.sharding import apply_sequence_split


def _heads(attn, x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, attn.head_dim))


class USPFlux2AttnProcessor(Flux2AttnProcessor):
    """Flux2AttnProcessor (double-stream blocks) with yunchang's attention over the shards.
    Keeps ``_attention_backend`` so per-request kernel switches reach yunchang's kernel map.
    Raises ``ValueError`` when called with an ``attention_mask``."""

    def __init__(self, usp: USPAttention):
        super().__init__()
        self.usp = usp

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise ValueError("sequence-parallel FLUX.2 attention takes no attention mask")
        query, key, value, encoder_query, encoder_key, encoder_value = compat.flux2_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query, key, value = attn.norm_q(_heads(attn, query)), attn.norm_k(_heads(attn, key)), _heads(attn, value)
        if attn.added_kv_proj_dim is not None:
            query = torch.cat([attn.norm_added_q(_heads(attn, encoder_query)), query], dim=1)
            key = torch.cat([attn.norm_added_k(_heads(attn, encoder_key)), key], dim=1)
            value = torch.cat([_heads(attn, encoder_value), value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        hidden_states = self.usp(query, key, value, kernel=kernel_for_backend(compat.get_processor_backend(self)))
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1)
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class USPFlux2ParallelSelfAttnProcessor(Flux2ParallelSelfAttnProcessor):
    """Flux2ParallelSelfAttnProcessor (single-stream blocks: fused QKV + MLP projection) with
    yunchang's attention over the shards. Raises ``ValueError`` when called with an
    ``attention_mask``."""

    def __init__(self, usp: USPAttention):
        super().__init__()
        self.usp = usp

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise ValueError("sequence-parallel FLUX.2 attention takes no attention mask")
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp_hidden_states = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
        query, key, value = qkv.chunk(3, dim=-1)
        query, key, value = attn.norm_q(_heads(attn, query)), attn.norm_k(_heads(attn, key)), _heads(attn, value)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        hidden_states = self.usp(query, key, value, kernel=kernel_for_backend(compat.get_processor_backend(self)))
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        hidden_states = torch.cat([hidden_states, attn.mlp_act_fn(mlp_hidden_states)], dim=-1)
        return attn.to_out(hidden_states)


def enable_sequence_parallel(transformer: torch.nn.Module, config: ParallelConfig, mesh, rank: int) -> None:
    """Shard a FLUX.2 ``transformer``'s sequence across the mesh: yunchang attention in every
    attention layer, diffusers' split/gather hooks from its ``_cp_plan``. Raises ``ValueError``
    when the transformer has no ``_cp_plan``."""
    usp = USPAttention(transformer.device.type, config.ring_degree)
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if isinstance(processor, Flux2ParallelSelfAttnProcessor):
            module.set_processor(USPFlux2ParallelSelfAttnProcessor(usp))
        elif isinstance(processor, Flux2AttnProcessor):
            module.set_processor(USPFlux2AttnProcessor(usp))
    apply_sequence_split(transformer, config, mesh, rank)
