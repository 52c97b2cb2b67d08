"""A random-weight tiny FLUX.2-architecture checkpoint, written in diffusers format.

Components as FLUX.2 [dev]: ``Flux2Transformer2DModel`` (4-axis rotary ids, shared
modulation, guidance embedding), ``AutoencoderKLFlux2`` (latents patchified 2×2 and
batch-normalised), a ``Mistral3ForConditionalGeneration`` text encoder (Mistral text model +
Pixtral vision tower, as Mistral Small 3.1) with 30 layers so the pipeline's default hidden
layers (10, 20, 30) exist, a locally made tokenizer with a chat template (nothing downloaded),
and ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting (the pipeline computes ``mu``).
Built once on first use into ``$DITSERVE_CACHE_DIR`` and loaded with ``from_pretrained``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.tiny.store import arch_tag, cache_root, save_atomically
from pipeline.tiny.tokenizers import WORDS

TINY_FLUX2 = "tiny-flux2"
TINY_FLUX2_VERSION = "v1"
# Renders the conversations FLUX.2's pipeline builds (system + user, content as text parts).
CHAT_TEMPLATE = ("{% for message in messages %}{{ '[' + message['role'] + ']' }}"
                 "{% if message['content'] is string %}{{ message['content'] }}"
                 "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
                 "{% endif %}{% endfor %}{% endif %}{{ '[/' + message['role'] + ']' }}{% endfor %}")


@dataclass(frozen=True)
class TinyFlux2Arch:
    """Architecture knobs of a random-weight FLUX.2-style model. ``num_attention_heads``
    must be divisible by the Ulysses degree a test wants; ``sum(axes_dims_rope)`` equals
    ``attention_head_dim``; ``max_sequence_length``: text tokens per prompt (FLUX.2: 512)."""

    # cache-dit checks Fn_compute_blocks against each block list: at least 8 each so its default
    # (8) fits; more single-stream blocks, as FLUX.2 [dev] (8 + 48), leave it blocks to cache
    num_layers: int = 8
    num_single_layers: int = 16
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int, int] = (4, 4, 4, 4)
    text_hidden_size: int = 16
    text_layers: int = 30
    latent_channels: int = 4
    max_sequence_length: int = 128  # the chat template and system message take ~60 tokens
    seed: int = 0


def flux2_tokenizer(max_sequence_length: int):
    """A word-level tokenizer (the tiny models' words, then single characters) with a chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("".join(WORDS)) | set("abcdefghijklmnopqrstuvwxyz0123456789.,!?-'[]/_ "))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for token in [*WORDS, *chars]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=max_sequence_length)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_flux2_pipeline(arch: TinyFlux2Arch = TinyFlux2Arch()):
    """Return a ``diffusers.Flux2Pipeline`` with random weights drawn from ``arch.seed`` (float32, CPU)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    tokenizer = flux2_tokenizer(arch.max_sequence_length)
    torch.manual_seed(arch.seed + 1)
    text_config = MistralConfig(vocab_size=len(tokenizer), hidden_size=arch.text_hidden_size,
                                intermediate_size=2 * arch.text_hidden_size, num_hidden_layers=arch.text_layers,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                max_position_embeddings=256, pad_token_id=0)
    vision_config = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=32, patch_size=8, head_dim=8)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text_config,
                                                                   vision_config=vision_config,
                                                                   image_token_index=len(tokenizer) - 1))
    torch.manual_seed(arch.seed + 2)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * arch.latent_channels, num_layers=arch.num_layers,
        num_single_layers=arch.num_single_layers, attention_head_dim=arch.attention_head_dim,
        num_attention_heads=arch.num_attention_heads, joint_attention_dim=3 * arch.text_hidden_size,
        timestep_guidance_channels=32, mlp_ratio=2.0, axes_dims_rope=arch.axes_dims_rope)
    torch.manual_seed(arch.seed + 3)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16), layers_per_block=1, latent_channels=arch.latent_channels,
                             norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, sample_size=64)
    with torch.no_grad():  # running statistics as a trained VAE has them (not the identity)
        vae.bn.running_mean.uniform_(-0.2, 0.2)
        vae.bn.running_var.uniform_(0.5, 1.5)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ensure_tiny_flux2(root: Path | None = None, arch: TinyFlux2Arch = TinyFlux2Arch()) -> Path:
    """Return the directory of a tiny FLUX.2 checkpoint for ``arch``, building it on first use."""
    target = (root or cache_root()) / "models" / f"{TINY_FLUX2}-{TINY_FLUX2_VERSION}-{arch_tag(arch)}"
    if (target / "model_index.json").exists():
        return target
    return save_atomically(build_tiny_flux2_pipeline(arch), target)
