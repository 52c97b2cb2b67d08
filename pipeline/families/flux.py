"""FLUX.1 family: CLIP + T5 prompt encoding, packed 2×2 latents, one transformer step, VAE decode.

Mirrors diffusers' ``FluxPipeline`` (same helpers, same order of random draws) so our loop
reproduces its output exactly; the loop itself lives in ``pipeline.loop``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compat import diffusers as compat
from pipeline.families.base import count_blocks, load_pipeline, parameter_bytes, tokenizer_special_tokens, vae_config
from pipeline.modes import DualMode, GuidanceMode


@dataclass
class FluxConditioning:
    """Text conditioning of B samples.

    prompt_embeds: (B, L, joint_attention_dim) T5 states; pooled: (B, pooled_projection_dim)
    CLIP pooled output; text_ids: (L, 3) rotary ids (zeros). dtype: the text encoders'.
    """

    prompt_embeds: torch.Tensor
    pooled: torch.Tensor
    text_ids: torch.Tensor

    def select(self, index: torch.Tensor) -> "FluxConditioning":
        return FluxConditioning(self.prompt_embeds[index], self.pooled[index], self.text_ids)

    def to(self, device) -> "FluxConditioning":
        return FluxConditioning(self.prompt_embeds.to(device), self.pooled.to(device), self.text_ids.to(device))


class FluxFamily:
    """Adapter over a loaded ``diffusers.FluxPipeline`` (its modules, scheduler config, helpers).

    ``vae_scale_factor``: pixels per latent pixel, from the VAE's config (also when the VAE is
    not loaded: ``components="denoiser"``).
    """

    family = "flux"
    pipeline_classes = ("FluxPipeline",)
    dual_mode = DualMode.SINGLE
    boundary_ratio = None
    guidance_style = GuidanceMode.TRUE_CFG  # guidance embedding + diffusers' true CFG on a negative prompt
    temporal_factor = 0                     # images only

    def __init__(self, pipe, vae_scale_factor: int):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.device = pipe.transformer.device
        self.dtype = pipe.transformer.dtype
        self.vae_scale_factor = vae_scale_factor
        # FluxPipeline caps T5 at 512 tokens; a checkpoint may ship a shorter tokenizer.
        self.max_sequence_length = min(512, int(pipe.tokenizer_2.model_max_length))

    @classmethod
    def from_pretrained(cls, path, *, torch_dtype=torch.float32, device="cpu", components: str = "all",
                        vae_slicing: bool = False) -> "FluxFamily":
        from diffusers import AutoencoderKL, FluxPipeline

        pipe = load_pipeline(FluxPipeline, path, torch_dtype=torch_dtype, device=device, components=components,
                             encoders=("text_encoder", "text_encoder_2", "vae"), vae_slicing=vae_slicing)
        # as FluxPipeline computes it from a loaded VAE
        factor = 2 ** (len(vae_config(pipe, path, AutoencoderKL)["block_out_channels"]) - 1)
        return cls(pipe, factor)

    def parameter_bytes(self) -> int:
        return parameter_bytes(self.pipe)

    # -- static facts the ingress validates against -------------------------------------

    @property
    def spatial_factor(self) -> int:
        """Width and height must be multiples of this (pixels): VAE factor × 2×2 packing."""
        return self.vae_scale_factor * 2

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.transformer.config.guidance_embeds)

    @property
    def transformers(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.transformer}

    @property
    def num_attention_heads(self) -> int:
        return int(self.transformer.config.num_attention_heads)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return tokenizer_special_tokens(self.pipe.tokenizer, self.pipe.tokenizer_2)

    @property
    def num_blocks(self) -> int:
        """Double-stream plus single-stream blocks."""
        return count_blocks(self.transformer)

    def sequence_lengths(self, width: int, height: int, num_frames: int = 1) -> dict[str, int]:
        """Tokens per sample the transformer sees: packed image patches and T5 text tokens."""
        return {"image tokens": (height // self.spatial_factor) * (width // self.spatial_factor),
                "text tokens": self.max_sequence_length}

    def enable_sequence_parallel(self, config, mesh, rank: int) -> None:
        """Shard the transformer's sequence across the replica's ranks (``parallel.flux``)."""
        from parallel.flux import enable_sequence_parallel

        enable_sequence_parallel(self.transformer, config, mesh, rank)

    # -- one batch ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> FluxConditioning:
        """Encode B prompts with CLIP (pooled) and T5 (padded to ``max_sequence_length``)."""
        prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length)
        return FluxConditioning(prompt_embeds, pooled, text_ids)

    def prepare_latents(self, generators: list[torch.Generator], counts: list[int], params):
        """Initial noise, one generator per request drawing that request's ``count`` samples,
        at ``params.width`` × ``params.height`` pixels.

        Returns latents: (B, (h/2)·(w/2), 4·C) packed, dtype of the transformer, with
        B = sum(counts) and h, w the latent size; and img_ids: ((h/2)·(w/2), 3).
        """
        from diffusers.utils.torch_utils import randn_tensor

        height, width = params.height, params.width
        channels = self.transformer.config.in_channels // 4
        h = 2 * (int(height) // (self.vae_scale_factor * 2))
        w = 2 * (int(width) // (self.vae_scale_factor * 2))
        noise = [randn_tensor((count, channels, h, w), generator=g, device=self.device, dtype=self.dtype)
                 for g, count in zip(generators, counts, strict=True)]
        latents = torch.cat(noise)
        latents = compat.flux_pack_latents(latents, latents.shape[0], channels, h, w)
        img_ids = compat.flux_latent_image_ids(latents.shape[0], h // 2, w // 2, self.device, self.dtype)
        return latents, img_ids

    def scheduler_and_timesteps(self, num_inference_steps: int, params):
        """A fresh flow-matching scheduler for this batch and its timesteps (FLUX sigmas and
        shift ``mu`` from the image's packed sequence length, as ``FluxPipeline``)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        image_seq_len = self.sequence_lengths(params.width, params.height)["image tokens"]
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        if getattr(scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        cfg = scheduler.config
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    def guidance(self, embedded_guidance_scale: float | None, batch: int) -> torch.Tensor | None:
        """FLUX.1-dev's distilled guidance input: (B,) float32, or None without guidance embedding."""
        if not self.guidance_embeds or embedded_guidance_scale is None:
            return None
        return torch.full([1], embedded_guidance_scale, device=self.device, dtype=torch.float32).expand(batch)

    @torch.no_grad()
    def predict(self, latents, t, cond: FluxConditioning, guidance, positions, *, model: str = "transformer",
                branch: str = "cond"):
        """One transformer call: latents (B, S, 4·C) → velocity (B, S, 4·C). ``model`` is
        always ``"transformer"`` (FLUX.1 has one); ``positions`` are the img_ids."""
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        with self.transformer.cache_context(branch):
            return self.transformer(
                hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
                pooled_projections=cond.pooled, encoder_hidden_states=cond.prompt_embeds,
                txt_ids=cond.text_ids, img_ids=positions, joint_attention_kwargs={}, return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, params) -> np.ndarray:
        """Packed latents (B, S, 4·C) → images (B, params.height, params.width, 3) float32 in [0, 1]."""
        vae = self.pipe.vae
        latents = compat.flux_unpack_latents(latents, params.height, params.width, self.vae_scale_factor)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="np")
