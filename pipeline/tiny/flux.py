"""A random-weight tiny FLUX.1-architecture checkpoint, written in diffusers format.

The checkpoint has the FLUX.1 architecture (``FluxTransformer2DModel`` with guidance
embedding, ``AutoencoderKL``, CLIP and T5 text encoders, ``FlowMatchEulerDiscreteScheduler``
with FLUX.1-dev's shift settings) at a few MB. Weights come from ``torch.manual_seed``; the
tokenizers are made on the spot (``pipeline.tiny.tokenizers``). The directory is written once
(atomically) and then loaded with ``from_pretrained`` exactly like a real FLUX.1 checkpoint.
The trained ``tiny-flux`` (``pipeline/tiny/weights``) has the default architecture below.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.tiny.store import arch_tag, cache_root, save_atomically
from pipeline.tiny.tokenizers import clip_tokenizer, t5_config, t5_tokenizer

TINY_FLUX = "tiny-flux"
# Bump when the architecture or the build recipe changes: it names the cache directory.
# v2: 2 double + 8 single blocks, so cache-dit's default Fn_compute_blocks=8 fits.
TINY_FLUX_VERSION = "v2"


@dataclass(frozen=True)
class TinyFluxArch:
    """Architecture knobs of a random-weight FLUX.1-style model.

    ``num_attention_heads`` must be divisible by the Ulysses degree a test wants; the sum
    of ``axes_dims_rope`` must equal ``attention_head_dim`` (FLUX.1 uses 16 + 56 + 56 = 128).
    """

    num_layers: int = 2
    num_single_layers: int = 8
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    text_dim: int = 32
    latent_channels: int = 4
    vae_block_out_channels: tuple[int, ...] = (16, 32, 32)
    max_sequence_length: int = 32
    guidance_embeds: bool = True
    clip_word_tokens: bool = False  # CLIP BPE merges that make every word of WORDS one token
    seed: int = 0
    extra: dict = field(default_factory=dict)


def build_tiny_flux_pipeline(arch: TinyFluxArch = TinyFluxArch()):
    """Return a ``diffusers.FluxPipeline`` with random weights drawn from ``arch.seed``.

    All modules are float32 on CPU. Raises nothing on valid ``arch``; diffusers raises
    ``ValueError`` when ``sum(axes_dims_rope) != attention_head_dim``.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = clip_tokenizer(arch.clip_word_tokens)
    tokenizer_2 = t5_tokenizer(arch.max_sequence_length)

    torch.manual_seed(arch.seed)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=arch.text_dim,
            intermediate_size=2 * arch.text_dim,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            projection_dim=arch.text_dim,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    torch.manual_seed(arch.seed + 1)
    text_encoder_2 = T5EncoderModel(t5_config(T5Config, tokenizer_2, arch.text_dim))
    torch.manual_seed(arch.seed + 2)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=arch.latent_channels * 4,
        num_layers=arch.num_layers,
        num_single_layers=arch.num_single_layers,
        attention_head_dim=arch.attention_head_dim,
        num_attention_heads=arch.num_attention_heads,
        joint_attention_dim=arch.text_dim,
        pooled_projection_dim=arch.text_dim,
        guidance_embeds=arch.guidance_embeds,
        axes_dims_rope=tuple(arch.axes_dims_rope),
    )
    torch.manual_seed(arch.seed + 3)
    levels = len(arch.vae_block_out_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(arch.vae_block_out_channels),
        layers_per_block=1,
        latent_channels=arch.latent_channels,
        norm_num_groups=8,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    # FLUX.1-dev's scheduler config (resolution-dependent shift).
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        shift=3.0,
        use_dynamic_shifting=True,
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ensure_tiny_flux(root: Path | None = None, arch: TinyFluxArch = TinyFluxArch()) -> Path:
    """Return the directory of the ``tiny-flux`` checkpoint, building it on first use."""
    name = f"{TINY_FLUX}-{TINY_FLUX_VERSION}" if arch == TinyFluxArch() else f"{TINY_FLUX}-{arch_tag(arch)}"
    target = (root or cache_root()) / "models" / name
    if (target / "model_index.json").exists():
        return target
    return save_atomically(build_tiny_flux_pipeline(arch), target)


def ensure_tiny_flux_kontext(source: Path, root: Path | None = None) -> Path:
    """A FLUX.1 Kontext-style checkpoint: the weights at ``source`` (a FLUX.1 diffusers
    directory) saved as a ``FluxKontextPipeline`` (same components; Kontext differs only in how
    the pipeline feeds the reference image), built on first use. The tiny weights were not
    trained on reference edits: the checkpoint exercises the mechanics, not edit quality."""
    from diffusers import FluxKontextPipeline

    stamp = hashlib.sha1((source / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()).hexdigest()
    target = (root or cache_root()) / "models" / f"{TINY_FLUX}-kontext-{stamp[:12]}"
    if (target / "model_index.json").exists():
        return target
    pipe = FluxKontextPipeline.from_pretrained(str(source))
    return save_atomically(pipe, target)
