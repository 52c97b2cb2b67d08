"""Qwen-Image family: Qwen2.5-VL prompt encoding (a chat template whose system prefix is dropped,
padded with a text mask), packed 2×2 latents, one MMDiT step, a one-frame Wan-style VAE decode.

Mirrors diffusers' ``QwenImagePipeline`` (its public ``encode_prompt`` and ``prepare_latents``,
the same order of random draws, FLUX-style ``mu`` shifting) so our loop reproduces its output;
the loop itself lives in ``pipeline.loop``. Guidance is Qwen-Image's true CFG on a negative
prompt (``true_cfg_scale`` > 1), with its norm rescale: the combined prediction is scaled back to
the conditional prediction's norm per token (:meth:`QwenImageFamily.combine_guidance`).

Text is padded to the longest prompt of the batch with a mask (``encoder_hidden_states_mask``);
a request alone has none, as in diffusers. Under sequence parallelism the text is padded to a
multiple of the ranks (the model's ``_cp_plan`` splits it) and attention is masked across the
ranks (``parallel.qwen_image``).

Qwen-Image-Edit checkpoints (:class:`QwenImageEditFamily`, ``QwenImageEditPipeline``) edit by
reference: the image, resized to about 1024×1024 pixels at its aspect ratio, is seen twice —
by the Qwen2.5-VL encoder in the prompt (its vision tokens join the text) and as packed latent
tokens appended to the sample's sequence (a second entry of ``img_shapes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compat import diffusers as compat
from pipeline.families.base import (count_blocks, load_pipeline, parameter_bytes, run_vae, tokenizer_special_tokens,
                                    unchanged_latents, vae_config)
from pipeline.modes import DualMode, GuidanceMode, InputMode


@dataclass
class QwenImageConditioning:
    """Text conditioning of B samples: prompt_embeds (B, L, hidden) Qwen2.5-VL last hidden
    states after the template's system prefix, padded to the batch's longest prompt; mask
    (B, L) bool, True on real tokens (None: no padding)."""

    prompt_embeds: torch.Tensor
    mask: torch.Tensor | None

    def select(self, index: torch.Tensor) -> "QwenImageConditioning":
        return QwenImageConditioning(self.prompt_embeds[index], None if self.mask is None else self.mask[index])

    def to(self, device) -> "QwenImageConditioning":
        return QwenImageConditioning(self.prompt_embeds.to(device), None if self.mask is None else self.mask.to(device))


@dataclass
class QwenImagePositions:
    """The latent grid of the batch's samples as the transformer takes it: ``img_shapes``, one
    ``[(frames, h/2, w/2)]`` per sample."""

    img_shapes: list
    reference: torch.Tensor | None = None  # (B, S_ref, 4·z) packed reference latents (Qwen-Image-Edit)

    def to(self, device) -> "QwenImagePositions":
        return QwenImagePositions(self.img_shapes, None if self.reference is None else self.reference.to(device))


class QwenImageFamily:
    """Adapter over a loaded ``diffusers.QwenImagePipeline``. ``vae_scale_factor``: pixels per
    latent pixel (``2 ** len(temperal_downsample)`` of the VAE config, also when it is not loaded)."""

    family = "qwen-image"
    pipeline_classes = ("QwenImagePipeline",)
    dual_mode = DualMode.SINGLE
    boundary_ratio = None
    guidance_style = GuidanceMode.TRUE_CFG
    guidance_embeds = False
    temporal_factor = 0
    input_modes = ()
    max_input_images = 1
    cfg_threshold = 1.0  # only CFG-style families use it
    masked_attention = True  # text padded to the batch's longest prompt, masked
    min_steps = 2  # its scheduler's shift_terminal stretch divides 0 by 0 at 1 step (NaN)
    true_cfg_default = 4.0  # QwenImagePipeline's default: a negative prompt alone guides
    sequence_multiple = 1  # its latent tokens are split as they are
    requires_image = False  # text alone generates
    max_side = 0  # positions are computed for any size (no table to run past)
    max_latent_frames = 0  # an image model
    max_aspect_ratio = 0.0  # any
    longest_block_list = 0  # cache-dit caches one list: num_blocks

    def __init__(self, pipe, vae_scale_factor: int):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.device = pipe.transformer.device
        self.dtype = self.prediction_dtype = pipe.transformer.dtype
        self.vae_scale_factor = vae_scale_factor
        pipe.vae_scale_factor = vae_scale_factor  # the pipeline's is 8 without a loaded VAE (denoiser ranks)
        # QwenImagePipeline.__call__'s default (its encoder could take tokenizer_max_length, 1024)
        self.max_sequence_length = min(512, int(pipe.tokenizer_max_length))
        self.text_multiple = 1  # sequence parallelism: text padded to a multiple of the ranks

    @classmethod
    def from_pretrained(cls, path, *, torch_dtype=torch.float32, device="cpu", components: str = "all",
                        vae_slicing: bool = False) -> "QwenImageFamily":
        from diffusers import AutoencoderKLQwenImage, QwenImagePipeline

        pipe = load_pipeline(QwenImagePipeline, path, torch_dtype=torch_dtype, device=device, components=components,
                             encoders=("text_encoder", "vae"), vae_slicing=vae_slicing)
        factor = 2 ** len(vae_config(pipe, path, AutoencoderKLQwenImage)["temperal_downsample"])
        return cls(pipe, factor)

    def parameter_bytes(self) -> int:
        return parameter_bytes(self.pipe)

    # -- static facts the ingress validates against -------------------------------------
    @property
    def spatial_factor(self) -> int:
        """Width and height must be multiples of this (pixels): VAE factor × 2×2 packing."""
        return self.vae_scale_factor * 2

    @property
    def transformers(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.transformer}

    @property
    def num_attention_heads(self) -> int:
        return int(self.transformer.config.num_attention_heads)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return tokenizer_special_tokens(self.pipe.tokenizer)

    @property
    def num_blocks(self) -> int:
        return count_blocks(self.transformer)

    def sequence_lengths(self, width: int, height: int, num_frames: int = 1) -> dict[str, int]:
        """Tokens per sample: packed latent patches, and at most ``max_sequence_length`` text tokens."""
        return {"image tokens": (height // self.spatial_factor) * (width // self.spatial_factor),
                "text tokens": self.max_sequence_length}

    def enable_sequence_parallel(self, config, mesh, rank: int) -> None:
        """Shard the transformer's sequence across the ranks (``parallel.qwen_image``); text is
        padded to a multiple of ``world_size`` from now on."""
        from parallel.qwen_image import enable_sequence_parallel

        enable_sequence_parallel(self.transformer, config, mesh, rank)
        self.text_multiple = config.world_size

    # -- one batch ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images=None) -> QwenImageConditioning:
        """Encode B prompts (``QwenImagePipeline.encode_prompt``: template, last hidden states, the
        system prefix dropped), padded to the longest (and to a multiple of the ranks) with a mask.
        ``images``: unused (text-to-image)."""
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device, num_images_per_prompt=1,
                                               max_sequence_length=self.max_sequence_length)
        return self._padded(embeds, mask)

    def _padded(self, embeds: torch.Tensor, mask: torch.Tensor | None) -> QwenImageConditioning:
        """Prompt embeddings (B, L, hidden) and their mask padded to a multiple of the ranks."""
        pad = -embeds.shape[1] % self.text_multiple
        if pad:
            if mask is None:
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            embeds = torch.nn.functional.pad(embeds, (0, 0, 0, pad))
            mask = torch.nn.functional.pad(mask, (0, pad))
        return QwenImageConditioning(embeds.to(self.dtype), None if mask is None else mask.bool())

    def prepare_latents(self, generators: list[torch.Generator], counts: list[int], params, requests=None,
                        schedule=None):
        """Initial noise, one generator per request drawing its ``count`` samples
        (``QwenImagePipeline.prepare_latents``): latents (B, (h/2)·(w/2), 4·z) packed, and the
        batch's :class:`QwenImagePositions`."""
        noise = [self._noise(count, params, g) for g, count in zip(generators, counts, strict=True)]
        latents = torch.cat(noise)
        grid = (1, params.height // self.spatial_factor, params.width // self.spatial_factor)
        return latents, QwenImagePositions([[grid]] * latents.shape[0])

    def _noise(self, count: int, params, generator: torch.Generator) -> torch.Tensor:
        """``count`` samples of packed noise (count, S, 4·z) drawn from ``generator``."""
        channels = self.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(count, channels, params.height, params.width, self.dtype, self.device,
                                         generator)

    after_step = staticmethod(unchanged_latents)  # no image inputs

    @staticmethod
    def select_positions(positions: QwenImagePositions, index: torch.Tensor) -> QwenImagePositions:
        """The latent grids (and reference latents) of samples ``index``."""
        return QwenImagePositions([positions.img_shapes[i] for i in index.tolist()],
                                  None if positions.reference is None else positions.reference[index])

    def scheduler_and_timesteps(self, num_inference_steps: int, params):
        """A fresh flow-matching scheduler and its timesteps (``mu`` from the packed sequence
        length, as ``QwenImagePipeline``)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        image_seq_len = self.sequence_lengths(params.width, params.height)["image tokens"]
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        cfg = scheduler.config
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    def guidance(self, embedded_guidance_scale: float | None, batch: int) -> None:
        """Qwen-Image has no guidance embedding: always None."""

    @staticmethod
    def combine_guidance(cond: torch.Tensor, guide: torch.Tensor, scale: float) -> torch.Tensor:
        """Qwen-Image's true CFG: ``guide + scale · (cond − guide)``, rescaled per token to the
        norm of ``cond`` (``QwenImagePipeline``): (B, S, C) → (B, S, C)."""
        combined = guide + scale * (cond - guide)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    @torch.no_grad()
    def predict(self, latents, t, cond: QwenImageConditioning, guidance, positions: QwenImagePositions, *,
                model: str = "transformer", branch: str = "cond"):
        """One transformer call: latents (B, S, 4·z) → velocity (B, S, 4·z), text masked where padded
        (reference latents, when the positions carry them, join the sequence and their part of
        the output is dropped, as ``QwenImageEditPipeline``)."""
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        hidden = latents
        if positions.reference is not None:
            hidden = torch.cat([latents, positions.reference.to(latents.dtype)], dim=1)
        with self.transformer.cache_context(branch):
            out = self.transformer(
                hidden_states=hidden, timestep=timestep / 1000, guidance=None,
                encoder_hidden_states_mask=cond.mask, encoder_hidden_states=cond.prompt_embeds,
                img_shapes=positions.img_shapes[:latents.shape[0]], attention_kwargs={}, return_dict=False)[0]
        return out if positions.reference is None else out[:, :latents.shape[1]]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, params, vae_decode=None) -> np.ndarray | None:
        """Packed latents (B, S, 4·z) → images (B, params.height, params.width, 3) float32 in [0, 1]
        (unpacked 2×2, de-normalised with the VAE's latents mean / std, one frame decoded)."""
        vae = self.pipe.vae
        h, w = params.height // self.spatial_factor, params.width // self.spatial_factor
        batch, _, channels = latents.shape
        x = latents.view(batch, h, w, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        x = x.reshape(batch, channels // 4, 1, 2 * h, 2 * w).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(x)
        std = torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(x)
        image = run_vae(vae, x * std + mean, vae_decode)
        if image is None:
            return None
        image = image[:, :, 0]
        return self.pipe.image_processor.postprocess(image, output_type="np")

    def decode_preview(self, latents: torch.Tensor, params) -> np.ndarray:
        """Previews are decoded as the final image."""
        return self.decode(latents, params)


# QwenImageEditPipeline resizes the edited image to this many pixels at its aspect ratio
# (``calculate_dimensions(1024 * 1024, ratio)``), for the text encoder and the reference latents alike.
EDIT_IMAGE_AREA = 1024 * 1024


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit checkpoints (``QwenImageEditPipeline``): reference editing. The image, at
    :data:`EDIT_IMAGE_AREA` pixels with the output's aspect ratio, conditions the prompt (and the
    negative prompt) through the Qwen2.5-VL encoder's vision tower and joins the sequence as
    packed reference latents."""

    family = "qwen-image-edit"
    pipeline_classes = ("QwenImageEditPipeline",)
    input_modes = (InputMode.REFERENCE,)
    requires_image = True  # QwenImageEditPipeline always edits an image
    # Qwen2-VL's processor refuses an image over 200:1, and edit_size (about 1 MP in multiples of
    # 32) stretches an output past about 164:1 to that (its short side rounds down to 64 pixels)
    max_aspect_ratio = 128.0

    @classmethod
    def from_pretrained(cls, path, *, torch_dtype=torch.float32, device="cpu", components: str = "all",
                        vae_slicing: bool = False) -> "QwenImageEditFamily":
        """Load the checkpoint; its ``processor`` through ``compat.transformers.qwen2vl_processor``
        (without torchvision its video processor is left out: edits give it none)."""
        from pathlib import Path

        from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline

        from compat.transformers import qwen2vl_processor

        given = {"processor": qwen2vl_processor(Path(path) / "processor")} if components == "all" else {}
        pipe = load_pipeline(QwenImageEditPipeline, path, torch_dtype=torch_dtype, device=device,
                             components=components, encoders=("text_encoder", "vae", "processor"),
                             vae_slicing=vae_slicing, given=given)
        factor = 2 ** len(vae_config(pipe, path, AutoencoderKLQwenImage)["temperal_downsample"])
        return cls(pipe, factor)

    def enable_sequence_parallel(self, config, mesh, rank: int) -> None:
        """As :meth:`QwenImageFamily.enable_sequence_parallel`. The reference tokens join each
        sample's split sequence; their count, ``(w_ref/16)·(h_ref/16)`` with both sides multiples of
        32 pixels, is a multiple of 4, so the ranks must divide 4 for every edit to split (the
        sample's own tokens are checked per request). Raises ``ValueError`` otherwise."""
        if 4 % config.sp_degree:
            raise ValueError(f"Qwen-Image-Edit's reference tokens are a multiple of 4: ulysses_degree x "
                             f"ring_degree = {config.sp_degree} must divide 4")
        super().enable_sequence_parallel(config, mesh, rank)

    def edit_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) in pixels the edited image is resized to for an output of
        ``width`` × ``height`` (its aspect ratio): ``calculate_dimensions`` of diffusers'
        ``QwenImageEditPipeline`` (multiples of 32)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        w, h, _ = calculate_dimensions(EDIT_IMAGE_AREA, width / height)
        return int(w), int(h)

    def _edit_images(self, images) -> list:
        """Each sample's first input image (:class:`pipeline.wire.ImageArray`) as the PIL image
        ``QwenImageEditPipeline`` gives its processor (resized to :meth:`edit_size`)."""
        from PIL import Image

        resized = []
        for image in images:
            pil = Image.fromarray(image.array())
            w, h = self.edit_size(*pil.size)
            resized.append(self.pipe.image_processor.resize(pil, h, w))
        return resized

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images=None) -> QwenImageConditioning:
        """Encode B prompts, each with its sample's image (``images``: per prompt the request's
        input images, the first is used) through ``QwenImageEditPipeline.encode_prompt``: the edit
        template, the image's vision tokens in the text, last hidden states, the system prefix
        dropped; padded like :meth:`QwenImageFamily.encode_prompts`. Raises ``ValueError``
        without images."""
        if images is None or any(not imgs for imgs in images):
            raise ValueError("Qwen-Image-Edit encodes every prompt with its input image")
        pil = self._edit_images([imgs[0] for imgs in images])
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, image=pil, device=self.device, num_images_per_prompt=1,
                                               max_sequence_length=self.max_sequence_length)
        return self._padded(embeds, mask)

    def prepare_latents(self, generators: list[torch.Generator], counts: list[int], params, requests=None,
                        schedule=None):
        """Initial noise as :meth:`QwenImageFamily.prepare_latents` and each request's image as
        reference latents: resized to :meth:`edit_size`, the VAE's mode, normalised with the
        latents mean / std and packed 2×2 (``QwenImageEditPipeline.prepare_latents``), repeated
        for the request's samples. Positions: ``img_shapes`` ``[(1, h/2, w/2), (1, h_ref/2,
        w_ref/2)]`` per sample and the reference (B, S_ref, 4·z)."""
        latents, positions = super().prepare_latents(generators, counts, params)  # the noise draws only
        ref_w, ref_h = self.edit_size(params.width, params.height)
        pixels = self.pipe.image_processor.preprocess(self._edit_images([r.images[0] for r in requests]), ref_h, ref_w)
        pixels = pixels.unsqueeze(2).to(device=self.device, dtype=self.pipe.vae.dtype)
        references = [compat.qwen_edit_reference_latents(self.pipe, pixels[i:i + 1]).to(self.dtype).expand(count, -1, -1)
                      for i, count in enumerate(counts)]
        grid = positions.img_shapes[0][0]
        ref_grid = (1, ref_h // self.spatial_factor, ref_w // self.spatial_factor)
        return latents, QwenImagePositions([[grid, ref_grid]] * latents.shape[0], torch.cat(references))

    def _noise(self, count: int, params, generator: torch.Generator) -> torch.Tensor:
        """As :meth:`QwenImageFamily._noise` (``QwenImageEditPipeline.prepare_latents`` takes the image first)."""
        channels = self.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(None, count, channels, params.height, params.width, self.dtype, self.device,
                                         generator)[0]
