"""Sequence parallelism for Qwen-Image transformers (``QwenImageTransformer2DModel``).

Inputs are split and the output gathered by diffusers' own context-parallel hooks from the
model's ``_cp_plan`` (image and text tokens, the text mask and both rotary tables split along
the sequence; ``proj_out`` gathered). Attention runs through yunchang: without padded text,
``LongContextAttention`` (Ulysses, ring or both); with it, under Ulysses alone
:func:`parallel.attention.masked_ulysses_attention` (yunchang's all-to-all, the key mask
all-gathered), with a ring :func:`parallel.attention.masked_usp_attention` (each shard's key
mask carried in its keys through every hop).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage import (QwenDoubleStreamAttnProcessor2_0,
                                                                 apply_rotary_emb_qwen)

from compat import diffusers as compat
from parallel.attention import USPAttention, masked_ulysses_attention, masked_usp_attention
from parallel.config import ParallelConfig
from parallel.kernels import kernel_for_backend
from parallel.sharding import apply_sequence_split


class USPQwenDoubleStreamAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """QwenDoubleStreamAttnProcessor2_0 with the joint attention over the ranks' shards. Keeps
    ``_attention_backend`` so per-request kernel switches reach the kernel."""

    def __init__(self, usp: USPAttention):
        super().__init__()
        self.usp = usp

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("sequence-parallel Qwen-Image attention takes the text stream and no external mask")
        seq_txt = encoder_hidden_states.shape[1]
        head_dim = attn.inner_dim // attn.heads

        def heads(x):
            return x.unflatten(-1, (-1, head_dim))

        img_q, img_k, img_v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(
            attn.to_v(hidden_states))
        txt_q, txt_k, txt_v = (heads(attn.add_q_proj(encoder_hidden_states)),
                               heads(attn.add_k_proj(encoder_hidden_states)),
                               heads(attn.add_v_proj(encoder_hidden_states)))
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q, img_k = (apply_rotary_emb_qwen(x, img_freqs, use_real=False) for x in (img_q, img_k))
            txt_q, txt_k = (apply_rotary_emb_qwen(x, txt_freqs, use_real=False) for x in (txt_q, txt_k))
        query, key, value = (torch.cat(pair, dim=1) for pair in ((txt_q, img_q), (txt_k, img_k), (txt_v, img_v)))
        backend = compat.get_processor_backend(self)
        if encoder_hidden_states_mask is None:
            joint = self.usp(query, key, value, kernel=kernel_for_backend(backend))
        else:
            image_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            key_mask = torch.cat([encoder_hidden_states_mask.bool(), image_mask], dim=1)
            if self.usp.ring_degree == 1:
                joint = masked_ulysses_attention(query, key, value, key_mask, backend=compat.processor_backend(self))
            else:
                joint = masked_usp_attention(self.usp, query, key, value, key_mask,
                                             kernel=kernel_for_backend(backend))
        joint = joint.flatten(2, 3).to(query.dtype)
        txt_out, img_out = joint[:, :seq_txt], joint[:, seq_txt:]
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_out.contiguous())


def enable_sequence_parallel(transformer: torch.nn.Module, config: ParallelConfig, mesh, rank: int) -> None:
    """Shard a Qwen-Image ``transformer``'s sequence across the mesh."""
    usp = USPAttention(transformer.device.type, config.ring_degree)
    for module in transformer.modules():
        if isinstance(getattr(module, "processor", None), QwenDoubleStreamAttnProcessor2_0):
            module.set_processor(USPQwenDoubleStreamAttnProcessor(usp))
    apply_sequence_split(transformer, config, mesh, rank)
