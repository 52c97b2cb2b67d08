"""A random-weight tiny Qwen-Image-architecture checkpoint, written in diffusers format.

Components as Qwen-Image: ``QwenImageTransformer2DModel`` (MMDiT, 3-axis rotary, text mask),
``AutoencoderKLQwenImage`` (Wan-style causal VAE, one frame), a
``Qwen2_5_VLForConditionalGeneration`` text encoder (Qwen2.5-VL: text model + vision tower)
with a locally made tokenizer whose ``<|im_start|>`` / ``<|im_end|>`` are single tokens and
which splits the pipeline's prompt template into the same 34 tokens before the user's text as
Qwen's own tokenizer (``prompt_template_encode_start_idx``), and ``FlowMatchEulerDiscreteScheduler``
with Qwen-Image's dynamic shifting. Built once on first use into ``$DITSERVE_CACHE_DIR``.

``tiny-qwen-image-edit`` (:func:`ensure_tiny_qwen_image_edit`) is the same architecture as a
``QwenImageEditPipeline``: the tokenizer also knows Qwen2.5-VL's vision markers
(``<|vision_start|>``, ``<|image_pad|>``, ...), whose ids the text encoder's config names, and
a ``Qwen2VLProcessor`` (Pillow image processor, Qwen2-VL's default patching: 14-pixel patches,
2×2 merge) turns the edited image into the vision tower's input.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.tiny.store import arch_tag, cache_root, save_atomically
from pipeline.tiny.tokenizers import WORDS

TINY_QWEN_IMAGE = "tiny-qwen-image"
TINY_QWEN_IMAGE_VERSION = "v1"
TINY_QWEN_IMAGE_EDIT = "tiny-qwen-image-edit"
TEMPLATE_WORDS = ("system user assistant Describe image detailing color shape size texture quantity text spatial "
                  "relationships objects background").split()
# QwenImageEditPipeline's prompt template (its system prompt) in words the tokenizer knows whole
EDIT_TEMPLATE_WORDS = ("key features input then explain how user s instruction should alter modify Generate new "
                       "that meets requirements while maintaining consistency original where appropriate").split()
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class TinyQwenImageArch:
    """Architecture knobs of a random-weight Qwen-Image-style model (``num_attention_heads``
    divisible by the Ulysses degree a test wants; ``sum(axes_dims_rope) == attention_head_dim``)."""

    num_layers: int = 10  # cache-dit's default Fn_compute_blocks=8 fits, with blocks left to cache
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    text_hidden_size: int = 32
    z_dim: int = 4
    seed: int = 0


# The edit model sees every reference at ~1024x1024 pixels (4096 tokens, QwenImageEditPipeline's
# area): fewer blocks and heads keep its tests cheap on CPU (attention over those tokens was most
# of a step; tests pass small Cache-DiT Fn/Bn knobs for it).
EDIT_ARCH = TinyQwenImageArch(num_layers=4, num_attention_heads=2)


def qwen_tokenizer(vision: bool = False):
    """A word-level tokenizer with Qwen's chat markers as special tokens (nothing downloaded);
    ``vision``: also Qwen2.5-VL's vision markers (:data:`VISION_TOKENS`) and the edit template's words."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>", *(VISION_TOKENS if vision else ())]
    vocab = {"<|endoftext|>": 0, "<unk>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "\n": 4}
    for token in specials:
        vocab.setdefault(token, len(vocab))
    chars = sorted(set("".join(WORDS)) | set("abcdefghijklmnopqrstuvwxyz0123456789.,!?-':;") | set("()" if vision else ""))
    for token in [*WORDS, *TEMPLATE_WORDS, *(EDIT_TEMPLATE_WORDS if vision else ()), *chars]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
                                                 pre_tokenizers.Split(Regex(r"\w+|\n|[^\w\s]"), behavior="isolated")])
    # the edit template's text holds the image's tokens too (up to Qwen2-VL's 1280 merged patches)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<unk>", additional_special_tokens=specials,
                                   model_max_length=1024 + 34 + (2048 if vision else 0))
    return fast


def build_tiny_qwen_image_pipeline(arch: TinyQwenImageArch = TinyQwenImageArch(), edit: bool = False):
    """Return a ``diffusers.QwenImagePipeline`` (``edit``: a ``QwenImageEditPipeline``) with random
    weights drawn from ``arch.seed`` (float32, CPU)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline,
                           QwenImagePipeline, QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from compat.transformers import image_only_qwen2vl_processor_class

    tokenizer = qwen_tokenizer(vision=edit)
    torch.manual_seed(arch.seed + 1)
    hidden = arch.text_hidden_size
    ids = {"image_token_id": len(tokenizer) - 1, "video_token_id": len(tokenizer) - 2,
           "vision_start_token_id": len(tokenizer) - 3}
    if edit:  # the tokenizer's own vision markers
        ids = {"image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
               "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
               "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>")}
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "max_position_embeddings": 4096 if edit else 2048, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                     "bos_token_id": 0, "eos_token_id": 3, "pad_token_id": 0},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                       "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "fullatt_block_indexes": [0]},
        vocab_size=len(tokenizer), hidden_size=hidden, bos_token_id=0, eos_token_id=3, pad_token_id=0, **ids)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    torch.manual_seed(arch.seed + 2)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * arch.z_dim, out_channels=arch.z_dim, num_layers=arch.num_layers,
        attention_head_dim=arch.attention_head_dim, num_attention_heads=arch.num_attention_heads,
        joint_attention_dim=hidden, axes_dims_rope=arch.axes_dims_rope)
    torch.manual_seed(arch.seed + 3)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=arch.z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], latents_mean=[0.0] * arch.z_dim,
                                 latents_std=[1.0] * arch.z_dim)
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler config
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
        shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential")
    if edit:
        # Qwen2-VL's default image processor (the Pillow backend: no torchvision needed)
        processor = image_only_qwen2vl_processor_class()(image_processor=Qwen2VLImageProcessorPil(),
                                                          tokenizer=tokenizer)
        pipe = QwenImageEditPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                     processor=processor, transformer=transformer)
    else:
        pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                 transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ensure_tiny_qwen_image(root: Path | None = None, arch: TinyQwenImageArch = TinyQwenImageArch()) -> Path:
    """Return the directory of a tiny Qwen-Image checkpoint for ``arch``, building it on first use."""
    target = (root or cache_root()) / "models" / f"{TINY_QWEN_IMAGE}-{TINY_QWEN_IMAGE_VERSION}-{arch_tag(arch)}"
    if (target / "model_index.json").exists():
        return target
    return save_atomically(build_tiny_qwen_image_pipeline(arch), target)


def ensure_tiny_qwen_image_edit(root: Path | None = None, arch: TinyQwenImageArch = EDIT_ARCH) -> Path:
    """Return the directory of a tiny Qwen-Image-Edit checkpoint for ``arch``, building it on first use."""
    target = (root or cache_root()) / "models" / f"{TINY_QWEN_IMAGE_EDIT}-{TINY_QWEN_IMAGE_VERSION}-{arch_tag(arch)}"
    if (target / "model_index.json").exists():
        return target
    return save_atomically(build_tiny_qwen_image_pipeline(arch, edit=True), target)
