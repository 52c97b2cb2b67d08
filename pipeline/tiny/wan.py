"""Random-weight tiny Wan 2.1 / 2.2-architecture checkpoints, written in diffusers format."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.tiny.store import arch_tag, cache_root, save_atomically
from pipeline.tiny.tokenizers import t5_config, t5_tokenizer

TINY_WAN = "tiny-wan"              # Wan 2.1-style: one transformer
TINY_WAN_MOE = "tiny-wan-moe"      # Wan 2.2 A14B-style: high-/low-noise experts switched at boundary_ratio
TINY_WAN_PAIRED = "tiny-wan-paired"  # two transformers at every step (the second one guides)
TINY_WAN_I2V = "tiny-wan-i2v"      # Wan 2.2 TI2V-style: image-to-video by latent conditioning
TINY_WAN_VERSION = "v1"
# A sidecar in a checkpoint directory that names ditserve's execution mode of a second
# transformer that diffusers' pipeline class does not know (``paired``).
DITSERVE_JSON = "ditserve.json"


@dataclass(frozen=True)
class TinyWanArch:
    """Architecture knobs of a random-weight Wan-style text-to-video model.

    ``dual``: None (one transformer), ``"boundary"`` (``transformer_2`` serves the low-noise
    steps below ``boundary_ratio``, as Wan 2.2 A14B) or ``"paired"`` (both run every step).
    ``num_attention_heads`` must be divisible by the Ulysses degree a test wants. ``i2v``: a
    ``WanImageToVideoPipeline`` with ``expand_timesteps`` (Wan 2.2 TI2V's latent conditioning;
    no image encoder, the transformer as text-to-video's).
    """

    num_layers: int = 10
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    text_dim: int = 32
    z_dim: int = 4
    vae_base_dim: int = 8
    max_sequence_length: int = 32
    dual: str | None = None
    i2v: bool = False
    boundary_ratio: float = 0.875  # Wan 2.2 A14B text-to-video's value
    seed: int = 0


def _tiny_wan_transformer(arch: TinyWanArch, seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=arch.num_attention_heads,
        attention_head_dim=arch.attention_head_dim,
        in_channels=arch.z_dim,
        out_channels=arch.z_dim,
        text_dim=arch.text_dim,
        freq_dim=32,
        ffn_dim=2 * arch.num_attention_heads * arch.attention_head_dim,
        num_layers=arch.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=256,
    )


def build_tiny_wan_pipeline(arch: TinyWanArch = TinyWanArch()):
    """Return a ``diffusers.WanPipeline`` (``WanImageToVideoPipeline`` with ``arch.i2v``) with
    random weights drawn from ``arch.seed``.

    Components as Wan 2.1/2.2: ``WanTransformer3DModel`` (patch 1×2×2), ``AutoencoderKLWan``
    (spatial factor 8, temporal factor 4), UMT5 text encoder with a locally made tokenizer,
    ``UniPCMultistepScheduler`` with flow prediction and ``flow_shift`` 3.0 (Wan 2.1 T2V's
    setting at 480p). All float32 on CPU. Raises ``ValueError`` for an unknown ``arch.dual``.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    if arch.dual not in (None, "boundary", "paired"):
        raise ValueError(f"dual must be None, 'boundary' or 'paired', got {arch.dual!r}")
    tokenizer = t5_tokenizer(arch.max_sequence_length)
    torch.manual_seed(arch.seed + 1)
    text_encoder = UMT5EncoderModel(t5_config(UMT5Config, tokenizer, arch.text_dim))
    transformer = _tiny_wan_transformer(arch, arch.seed + 2)
    transformer_2 = _tiny_wan_transformer(arch, arch.seed + 4) if arch.dual else None
    torch.manual_seed(arch.seed + 3)
    vae = AutoencoderKLWan(
        base_dim=arch.vae_base_dim,
        z_dim=arch.z_dim,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * arch.z_dim,
        latents_std=[1.0] * arch.z_dim,
    )
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    boundary_ratio = arch.boundary_ratio if arch.dual == "boundary" else None
    if arch.i2v:
        pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                                       image_processor=None, image_encoder=None, transformer=transformer,
                                       transformer_2=transformer_2, boundary_ratio=boundary_ratio,
                                       expand_timesteps=True)
    else:
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                           transformer=transformer, transformer_2=transformer_2, boundary_ratio=boundary_ratio)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ensure_tiny_wan(root: Path | None = None, arch: TinyWanArch = TinyWanArch()) -> Path:
    """Return the directory of a tiny Wan checkpoint for ``arch``, building it on first use.

    A ``paired`` model carries ``ditserve.json`` (``{"dual_transformer": "paired"}``).
    """
    name = f"{TINY_WAN}-{arch.dual or 'single'}{'-i2v' if arch.i2v else ''}-{TINY_WAN_VERSION}-{arch_tag(arch)}"
    target = (root or cache_root()) / "models" / name
    if (target / "model_index.json").exists():
        return target
    sidecar = {DITSERVE_JSON: json.dumps({"dual_transformer": "paired"}) + "\n"} if arch.dual == "paired" else {}
    return save_atomically(build_tiny_wan_pipeline(arch), target, extra_files=sidecar)
