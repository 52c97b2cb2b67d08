"""The embedded checkpoints: the trained ``tiny-flux`` shipped in the repository, and
builders of random-weight tiny FLUX.1 and Wan models written in diffusers format.

``tiny-flux`` (the default of the demo and the tiny configs) is trained on the procedural
shapes dataset by ``python -m pipeline.tiny.train --out pipeline/tiny/weights/tiny-flux``
and lives in ``pipeline/tiny/weights/tiny-flux``. ``tiny-flux-random`` and the builders
below give random weights for any architecture a test needs.

The random checkpoint has the FLUX.1 architecture (``FluxTransformer2DModel`` with guidance
embedding, ``AutoencoderKL``, CLIP and T5 text encoders, ``FlowMatchEulerDiscreteScheduler``
with FLUX.1-dev's shift settings) at a few MB. Weights come from ``torch.manual_seed``;
the tokenizers are made on the spot from a small word list, so nothing is downloaded.
The directory is written once (atomically) and then loaded with ``from_pretrained``
exactly like a real FLUX.1 checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

TINY_FLUX = "tiny-flux"
TINY_FLUX_RANDOM = "tiny-flux-random"
# The trained default, shipped with the package (about 5 MB, float32).
TRAINED_TINY_FLUX = Path(__file__).resolve().parent / "weights" / TINY_FLUX
# Bump when the architecture or the build recipe changes: it names the cache directory.
# v2: 2 double + 8 single blocks, so cache-dit's default Fn_compute_blocks=8 fits.
TINY_FLUX_VERSION = "v2"

# Words the tokenizers know whole; any other text falls back to single characters.
WORDS = (
    "a an the of on in with and or to is at by one two three small large big tiny "
    "red orange yellow green blue purple pink brown black white gray grey cyan magenta "
    "circle square triangle star ring cross heart diamond hexagon disk box "
    "background photo picture image painting drawing sketch of cat dog bird tree house "
    "sun moon sky sea mountain city car flower light dark bright night day"
).split()


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


def _word_merges() -> list[tuple[str, str]]:
    """BPE merges learned (with the ``tokenizers`` library's trainer) on WORDS, so each of
    them becomes one CLIP token; other text still falls back to bytes."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sorted(set(WORDS)), trainers.BpeTrainer(
        vocab_size=5000, show_progress=False, end_of_word_suffix="</w>", initial_alphabet=[]))
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]


def _clip_tokenizer(word_tokens: bool = False):
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Byte-level BPE vocabulary: every byte, alone and word-final, plus (word_tokens) merges
    # that make the known words whole tokens.
    byte_chars = list(bytes_to_unicode().values())
    vocab = {}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    for ch in byte_chars:
        vocab[ch + "</w>"] = len(vocab)
    merges = _word_merges() if word_tokens else []
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=merges)
    tok.model_max_length = 77
    return tok


def _t5_tokenizer(max_sequence_length: int):
    from transformers import T5TokenizerFast

    chars = sorted(set("".join(WORDS)) | set("abcdefghijklmnopqrstuvwxyz0123456789.,!?-'"))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0) for w in WORDS]
    vocab += [(c, -6.0) for c in chars]
    tok = T5TokenizerFast(vocab=vocab, extra_ids=0)
    tok.model_max_length = max_sequence_length
    return tok


def _t5_config(config_class, tokenizer, text_dim: int):
    """A 2-layer, 4-head T5-family encoder config (FLUX's T5, Wan's UMT5) of width ``text_dim``."""
    return config_class(
        vocab_size=len(tokenizer),
        d_model=text_dim,
        d_kv=8,
        d_ff=2 * text_dim,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def build_tiny_flux_pipeline(arch: TinyFluxArch = TinyFluxArch()):
    """Return a ``diffusers.FluxPipeline`` with random weights drawn from ``arch.seed``.

    All modules are float32 on CPU. Raises nothing on valid ``arch``; diffusers raises
    ``ValueError`` when ``sum(axes_dims_rope) != attention_head_dim``.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = _clip_tokenizer(arch.clip_word_tokens)
    tokenizer_2 = _t5_tokenizer(arch.max_sequence_length)

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
    text_encoder_2 = T5EncoderModel(_t5_config(T5Config, tokenizer_2, arch.text_dim))
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


def cache_root() -> Path:
    """Where built checkpoints live: ``$DITSERVE_CACHE_DIR`` or ``~/.cache/ditserve``."""
    return Path(os.environ.get("DITSERVE_CACHE_DIR", Path.home() / ".cache" / "ditserve"))


def save_atomically(pipe, target: Path) -> Path:
    """Write ``pipe`` with ``save_pretrained`` into ``target`` unless it is already there.

    Concurrent builders (two replicas starting together) each write a temporary directory
    and rename it into place; the first rename wins, the others are discarded.
    """
    if (target / "model_index.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model_index.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_tiny_flux(root: Path | None = None, arch: TinyFluxArch = TinyFluxArch()) -> Path:
    """Return the directory of the ``tiny-flux`` checkpoint, building it on first use."""
    name = f"{TINY_FLUX}-{TINY_FLUX_VERSION}" if arch == TinyFluxArch() else f"{TINY_FLUX}-{_arch_tag(arch)}"
    target = (root or cache_root()) / "models" / name
    if (target / "model_index.json").exists():
        return target
    return save_atomically(build_tiny_flux_pipeline(arch), target)


def _arch_tag(arch: TinyFluxArch) -> str:
    import hashlib

    return hashlib.sha1(repr(arch).encode()).hexdigest()[:12]


TINY_WAN = "tiny-wan"              # Wan 2.1-style: one transformer
TINY_WAN_MOE = "tiny-wan-moe"      # Wan 2.2 A14B-style: high-/low-noise experts switched at boundary_ratio
TINY_WAN_PAIRED = "tiny-wan-paired"  # two transformers at every step (the second one guides)
TINY_WAN_VERSION = "v1"
# A sidecar in a checkpoint directory that names ditserve's execution mode of a second
# transformer that diffusers' pipeline class does not know (``paired``).
DITSERVE_JSON = "ditserve.json"


@dataclass(frozen=True)
class TinyWanArch:
    """Architecture knobs of a random-weight Wan-style text-to-video model.

    ``dual``: None (one transformer), ``"boundary"`` (``transformer_2`` serves the low-noise
    steps below ``boundary_ratio``, as Wan 2.2 A14B) or ``"paired"`` (both run every step).
    ``num_attention_heads`` must be divisible by the Ulysses degree a test wants.
    """

    num_layers: int = 10
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    text_dim: int = 32
    z_dim: int = 4
    vae_base_dim: int = 8
    max_sequence_length: int = 32
    dual: str | None = None
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
    """Return a ``diffusers.WanPipeline`` with random weights drawn from ``arch.seed``.

    Components as Wan 2.1/2.2: ``WanTransformer3DModel`` (patch 1×2×2), ``AutoencoderKLWan``
    (spatial factor 8, temporal factor 4), UMT5 text encoder with a locally made tokenizer,
    ``UniPCMultistepScheduler`` with flow prediction and ``flow_shift`` 3.0 (Wan 2.1 T2V's
    setting at 480p). All float32 on CPU. Raises ``ValueError`` for an unknown ``arch.dual``.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    if arch.dual not in (None, "boundary", "paired"):
        raise ValueError(f"dual must be None, 'boundary' or 'paired', got {arch.dual!r}")
    tokenizer = _t5_tokenizer(arch.max_sequence_length)
    torch.manual_seed(arch.seed + 1)
    text_encoder = UMT5EncoderModel(_t5_config(UMT5Config, tokenizer, arch.text_dim))
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
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, transformer_2=transformer_2,
                       boundary_ratio=arch.boundary_ratio if arch.dual == "boundary" else None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ensure_tiny_wan(root: Path | None = None, arch: TinyWanArch = TinyWanArch()) -> Path:
    """Return the directory of a tiny Wan checkpoint for ``arch``, building it on first use.

    A ``paired`` model carries ``ditserve.json`` (``{"dual_transformer": "paired"}``).
    """
    name = f"{TINY_WAN}-{arch.dual or 'single'}-{TINY_WAN_VERSION}-{_arch_tag(arch)}"
    target = (root or cache_root()) / "models" / name
    if (target / "model_index.json").exists():
        return target
    pipe = build_tiny_wan_pipeline(arch)
    if arch.dual == "paired":
        original = pipe.save_pretrained

        def save_with_sidecar(directory, **kwargs):
            original(directory, **kwargs)
            (Path(directory) / DITSERVE_JSON).write_text('{"dual_transformer": "paired"}\n')

        pipe.save_pretrained = save_with_sidecar
    return save_atomically(pipe, target)


# The embedded checkpoints, by served model name.
def trained_tiny_flux() -> Path:
    """The shipped trained ``tiny-flux`` directory. Raises ``FileNotFoundError`` if the
    package was installed without it (retrain with ``python -m pipeline.tiny.train``)."""
    if not (TRAINED_TINY_FLUX / "model_index.json").exists():
        raise FileNotFoundError(f"the trained tiny-flux is missing from {TRAINED_TINY_FLUX}; recreate it with "
                                f"`python -m pipeline.tiny.train --out {TRAINED_TINY_FLUX}`")
    return TRAINED_TINY_FLUX


EMBEDDED = {
    TINY_FLUX: lambda root=None: trained_tiny_flux(),
    TINY_FLUX_RANDOM: lambda root=None: ensure_tiny_flux(root),
    TINY_WAN: lambda root=None: ensure_tiny_wan(root, TinyWanArch()),
    TINY_WAN_MOE: lambda root=None: ensure_tiny_wan(root, TinyWanArch(dual="boundary")),
    TINY_WAN_PAIRED: lambda root=None: ensure_tiny_wan(root, TinyWanArch(dual="paired")),
}


if __name__ == "__main__":
    for build in EMBEDDED.values():
        print(build())
