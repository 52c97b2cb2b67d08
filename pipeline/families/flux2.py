"""FLUX.2 family: Mistral 3 prompt encoding (three hidden layers stacked), 2×2-patchified
batch-normalised latents with 4-axis position ids, one transformer step, VAE decode.

Mirrors diffusers' ``Flux2Pipeline`` (its public ``encode_prompt`` and ``prepare_latents``, the
same order of random draws, FLUX.2's empirical ``mu``) so our loop reproduces its output; the
loop itself lives in ``pipeline.loop``. FLUX.2 [dev] is guidance-distilled: ``guidance_scale``
is the embedded guidance input. A request with ``true_cfg_scale`` > 1 and a negative prompt runs
a separate guiding forward as FLUX.1's true CFG does (our loop; ``Flux2Pipeline`` has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.families.base import (embedded_guidance, linear_guidance, load_pipeline, parameter_bytes, run_vae,
                                    tokenizer_special_tokens, unchanged_latents, vae_config)
from pipeline.modes import DualMode, GuidanceMode

TEXT_ENCODER_OUT_LAYERS = (10, 20, 30)  # Flux2Pipeline's default: the hidden states stacked per token


@dataclass
class Flux2Conditioning:
    """Text conditioning of B samples: prompt_embeds (B, L, 3·hidden) Mistral 3 states of three
    layers side by side; text_ids (B, L, 4) position ids (t, h, w, l). dtype: the encoder's."""

    prompt_embeds: torch.Tensor
    text_ids: torch.Tensor

    def select(self, index: torch.Tensor) -> "Flux2Conditioning":
        return Flux2Conditioning(self.prompt_embeds[index], self.text_ids[index])

    def to(self, device) -> "Flux2Conditioning":
        return Flux2Conditioning(self.prompt_embeds.to(device), self.text_ids.to(device))


class Flux2Family:
    """Adapter over a loaded ``diffusers.Flux2Pipeline``. ``vae_scale_factor``: pixels per latent
    pixel (from the VAE's config, also when the VAE is not loaded). Raises ``ValueError`` when the
    text encoder has fewer layers than ``TEXT_ENCODER_OUT_LAYERS`` needs."""

    family = "flux2"
    pipeline_classes = ("Flux2Pipeline",)
    dual_mode = DualMode.SINGLE
    boundary_ratio = None
    guidance_style = GuidanceMode.TRUE_CFG
    temporal_factor = 0
    input_modes = ()
    max_input_images = 1
    cfg_threshold = 1.0  # only CFG-style families use it
    masked_attention = False
    min_steps = 1
    true_cfg_default = 1.0  # the pipeline's default true_cfg_scale
    sequence_multiple = 1  # its latent tokens are split as they are
    requires_image = False  # text alone generates
    max_side = 0  # positions are computed for any size (no table to run past)
    max_latent_frames = 0  # an image model
    max_aspect_ratio = 0.0  # any

    def __init__(self, pipe, vae_scale_factor: int):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.device = pipe.transformer.device
        self.dtype = self.prediction_dtype = pipe.transformer.dtype
        self.vae_scale_factor = vae_scale_factor
        # Flux2Pipeline derives it from a loaded VAE (8 without one): ranks that load no VAE
        # (components="denoiser") must shape latents as rank 0 does
        pipe.vae_scale_factor = vae_scale_factor
        # FLUX.2 [dev] ships a PixtralProcessor; its text tokenizer is .tokenizer
        tokenizer = getattr(pipe.tokenizer, "tokenizer", pipe.tokenizer)
        self.max_sequence_length = min(512, int(tokenizer.model_max_length))
        encoder = pipe.text_encoder
        if encoder is not None:
            layers = encoder.config.text_config.num_hidden_layers
            if layers < max(TEXT_ENCODER_OUT_LAYERS):
                raise ValueError(f"FLUX.2's text encoder needs at least {max(TEXT_ENCODER_OUT_LAYERS)} layers "
                                 f"(hidden states {TEXT_ENCODER_OUT_LAYERS} are stacked); this one has {layers}")

    @classmethod
    def from_pretrained(cls, path, *, torch_dtype=torch.float32, device="cpu", components: str = "all",
                        vae_slicing: bool = False) -> "Flux2Family":
        from diffusers import AutoencoderKLFlux2, Flux2Pipeline

        pipe = load_pipeline(Flux2Pipeline, path, torch_dtype=torch_dtype, device=device, components=components,
                             encoders=("text_encoder", "vae"), vae_slicing=vae_slicing)
        factor = 2 ** (len(vae_config(pipe, path, AutoencoderKLFlux2)["block_out_channels"]) - 1)
        return cls(pipe, factor)

    def parameter_bytes(self) -> int:
        return parameter_bytes(self.pipe)

    # -- static facts the ingress validates against -------------------------------------
    @property
    def spatial_factor(self) -> int:
        """Width and height must be multiples of this (pixels): VAE factor × 2×2 patchify."""
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
        return tokenizer_special_tokens(self.pipe.tokenizer)

    @property
    def num_blocks(self) -> int:
        """The shorter of the double- and single-stream block lists: cache-dit's FLUX.2 adapter
        caches them as two lists and checks ``Fn_compute_blocks`` / ``Bn_compute_blocks`` against
        each (``cache_dit.caching.cache_blocks.pattern_base``)."""
        return min(len(self.transformer.transformer_blocks), len(self.transformer.single_transformer_blocks))

    @property
    def longest_block_list(self) -> int:
        """The longer block list (FLUX.2 [dev]: its 48 single-stream blocks)."""
        return max(len(self.transformer.transformer_blocks), len(self.transformer.single_transformer_blocks))

    def sequence_lengths(self, width: int, height: int, num_frames: int = 1) -> dict[str, int]:
        """Tokens per sample: patchified latent pixels and Mistral text tokens (both split under SP)."""
        return {"image tokens": (height // self.spatial_factor) * (width // self.spatial_factor),
                "text tokens": self.max_sequence_length}

    def enable_sequence_parallel(self, config, mesh, rank: int) -> None:
        """Shard the transformer's sequence across the replica's ranks (``parallel.flux2``). Raises
        ``ValueError`` when the padded text cannot split evenly (the ``_cp_plan`` splits it too)."""
        from parallel.flux2 import enable_sequence_parallel

        if self.max_sequence_length % config.world_size:
            raise ValueError(f"FLUX.2's {self.max_sequence_length} text tokens cannot split evenly across "
                             f"world_size={config.world_size} ranks")
        enable_sequence_parallel(self.transformer, config, mesh, rank)

    # -- one batch ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images=None) -> Flux2Conditioning:
        """Encode B prompts with the Mistral 3 encoder (chat template, padded to ``max_sequence_length``)."""
        prompt_embeds, text_ids = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length, text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS)
        return Flux2Conditioning(prompt_embeds, text_ids)

    def prepare_latents(self, generators: list[torch.Generator], counts: list[int], params, requests=None,
                        schedule=None):
        """Initial noise, one generator per request drawing that request's ``count`` samples, at
        ``params.width`` × ``params.height`` pixels (``Flux2Pipeline.prepare_latents``).

        Returns latents (B, (h/2)·(w/2), 4·C) packed, the transformer's dtype, and latent_ids
        (B, (h/2)·(w/2), 4) (t, h, w, l) position ids.
        """
        channels = self.transformer.config.in_channels // 4
        noise, ids = [], []
        for g, count in zip(generators, counts, strict=True):
            latents, latent_ids = self.pipe.prepare_latents(
                batch_size=count, num_latents_channels=channels, height=params.height, width=params.width,
                dtype=self.dtype, device=self.device, generator=g)
            noise.append(latents)
            ids.append(latent_ids)
        return torch.cat(noise), torch.cat(ids)

    combine_guidance = staticmethod(linear_guidance)

    after_step = staticmethod(unchanged_latents)  # no image inputs

    @staticmethod
    def select_positions(positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the latent ids (B, S, 4)."""
        return positions[index]

    def scheduler_and_timesteps(self, num_inference_steps: int, params):
        """A fresh flow-matching scheduler and its timesteps (FLUX.2's empirical ``mu`` from the
        packed sequence length and the step count, as ``Flux2Pipeline``)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

        image_seq_len = self.sequence_lengths(params.width, params.height)["image tokens"]
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        if getattr(scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_inference_steps)
        timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    def guidance(self, embedded_guidance_scale: float | None, batch: int) -> torch.Tensor | None:
        """FLUX.2's distilled guidance input: (B,) float32, or None without guidance embedding."""
        return embedded_guidance(self.guidance_embeds, embedded_guidance_scale, batch, self.device)

    @torch.no_grad()
    def predict(self, latents, t, cond: Flux2Conditioning, guidance, positions, *, model: str = "transformer",
                branch: str = "cond"):
        """One transformer call: latents (B, S, 4·C) → velocity (B, S, 4·C); ``positions`` are
        the latent ids (B, S, 4)."""
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        with self.transformer.cache_context(branch):
            return self.transformer(
                hidden_states=latents.to(self.dtype), timestep=timestep / 1000, guidance=guidance,
                encoder_hidden_states=cond.prompt_embeds, txt_ids=cond.text_ids, img_ids=positions,
                joint_attention_kwargs={}, return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, params, vae_decode=None) -> np.ndarray | None:
        """Packed latents (B, S, 4·C) → images (B, params.height, params.width, 3) float32 in [0, 1].
        The tokens are in row-major (h, w) order (``Flux2Pipeline._prepare_latent_ids``), so
        unpacking is a reshape; then the VAE's batch-norm statistics are undone and the 2×2
        patches unfolded, as ``Flux2Pipeline`` does before decoding."""
        vae = self.pipe.vae
        h = params.height // self.spatial_factor
        w = params.width // self.spatial_factor
        batch, _, channels = latents.shape
        x = latents.reshape(batch, h, w, channels).permute(0, 3, 1, 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(x.device, x.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(x.device, x.dtype)
        x = x * std + mean
        x = x.reshape(batch, channels // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(batch, channels // 4,
                                                                                           2 * h, 2 * w)
        image = run_vae(vae, x.to(vae.dtype), vae_decode)
        if image is None:  # a rank that shares a parallel decode without gathering it
            return None
        return self.pipe.image_processor.postprocess(image, output_type="np")

    def decode_preview(self, latents: torch.Tensor, params) -> np.ndarray:
        """Previews are decoded as the final image."""
        return self.decode(latents, params)
