"""A random-weight tiny Z-Image-architecture checkpoint, written in diffusers format.

Components as Z-Image (Turbo): ``ZImageTransformer2DModel`` (single-stream DiT over a unified
image + caption sequence, noise and context refiners), ``AutoencoderKL`` (FLUX.1-style, shift and
scale factors), a ``Qwen3Model`` text encoder (its second-to-last hidden states), the locally made
word-level tokenizer of ``pipeline.tiny.qwen_image`` with a Qwen3-style chat template, and
``FlowMatchEulerDiscreteScheduler`` with dynamic shifting. Built once on first use into
``$DITSERVE_CACHE_DIR``; nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.tiny.qwen_image import qwen_tokenizer
from pipeline.tiny.store import arch_tag, cache_root, save_atomically

TINY_Z_IMAGE = "tiny-z-image"
TINY_Z_IMAGE_VERSION = "v1"
# Qwen3's chat template, reduced to what ZImagePipeline renders (one user turn, a generation prompt)
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass(frozen=True)
class TinyZImageArch:
    """Architecture knobs of a random-weight Z-Image-style model (``n_heads`` divisible by the
    Ulysses degree a test wants; ``sum(axes_dims) == dim / n_heads``)."""

    dim: int = 64
    n_layers: int = 10  # cache-dit's default Fn_compute_blocks=8 fits, with blocks left to cache
    n_refiner_layers: int = 1
    n_heads: int = 4
    axes_dims: tuple[int, int, int] = (4, 6, 6)
    text_hidden_size: int = 32
    latent_channels: int = 4
    max_sequence_length: int = 128
    seed: int = 0


def build_tiny_z_image_pipeline(arch: TinyZImageArch = TinyZImageArch()):
    """Return a ``diffusers.ZImagePipeline`` with random weights drawn from ``arch.seed`` (float32, CPU)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = arch.max_sequence_length
    torch.manual_seed(arch.seed + 1)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=arch.text_hidden_size, intermediate_size=2 * arch.text_hidden_size,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=1024, bos_token_id=0, eos_token_id=3, pad_token_id=0))
    torch.manual_seed(arch.seed + 2)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=arch.latent_channels, dim=arch.dim,
        n_layers=arch.n_layers, n_refiner_layers=arch.n_refiner_layers, n_heads=arch.n_heads,
        n_kv_heads=arch.n_heads, cap_feat_dim=arch.text_hidden_size, axes_dims=list(arch.axes_dims),
        axes_lens=[1024, 128, 128])
    torch.manual_seed(arch.seed + 3)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=arch.latent_channels, norm_num_groups=8, sample_size=64,
                        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ensure_tiny_z_image(root: Path | None = None, arch: TinyZImageArch = TinyZImageArch()) -> Path:
    """Return the directory of a tiny Z-Image checkpoint for ``arch``, building it on first use."""
    target = (root or cache_root()) / "models" / f"{TINY_Z_IMAGE}-{TINY_Z_IMAGE_VERSION}-{arch_tag(arch)}"
    if (target / "model_index.json").exists():
        return target
    return save_atomically(build_tiny_z_image_pipeline(arch), target)
