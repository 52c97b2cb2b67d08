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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.families.base import (count_blocks, load_pipeline, parameter_bytes, run_vae, tokenizer_special_tokens,
                                    unchanged_latents, vae_config)
from pipeline.modes import DualMode, GuidanceMode


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

    def to(self, device) -> "QwenImagePositions":
        return self


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

    def __init__(self, pipe, vae_scale_factor: int):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.device = pipe.transformer.device
        self.dtype = pipe.transformer.dtype
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
    def encode_prompts(self, prompts: list[str]) -> QwenImageConditioning:
        """Encode B prompts (``QwenImagePipeline.encode_prompt``: template, last hidden states, the
        system prefix dropped), padded to the longest (and to a multiple of the ranks) with a mask."""
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device, num_images_per_prompt=1,
                                               max_sequence_length=self.max_sequence_length)
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
        channels = self.transformer.config.in_channels // 4
        noise = [self.pipe.prepare_latents(count, channels, params.height, params.width, self.dtype, self.device, g)
                 for g, count in zip(generators, counts, strict=True)]
        latents = torch.cat(noise)
        grid = (1, params.height // self.spatial_factor, params.width // self.spatial_factor)
        return latents, QwenImagePositions([[grid]] * latents.shape[0])

    after_step = staticmethod(unchanged_latents)  # no image inputs

    @staticmethod
    def select_positions(positions: QwenImagePositions, index: torch.Tensor) -> QwenImagePositions:
        """The latent grids of samples ``index``."""
        return QwenImagePositions([positions.img_shapes[i] for i in index.tolist()])

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
        """One transformer call: latents (B, S, 4·z) → velocity (B, S, 4·z), text masked where padded."""
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        with self.transformer.cache_context(branch):
            return self.transformer(
                hidden_states=latents, timestep=timestep / 1000, guidance=None,
                encoder_hidden_states_mask=cond.mask, encoder_hidden_states=cond.prompt_embeds,
                img_shapes=positions.img_shapes[:latents.shape[0]], attention_kwargs={}, return_dict=False)[0]

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
