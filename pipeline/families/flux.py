"""FLUX.1 family: CLIP + T5 prompt encoding, packed 2×2 latents, one transformer step, VAE decode.

Mirrors diffusers' ``FluxPipeline`` (same helpers, same order of random draws) so our loop
reproduces its output exactly; the loop itself lives in ``pipeline.loop``. Image inputs
mirror ``FluxImg2ImgPipeline`` (the image's VAE sample noised to ``strength``'s first
timestep), ``FluxInpaintPipeline`` (plus the unmasked region blended back after every step)
and, for FLUX.1 Kontext checkpoints (:class:`FluxKontextFamily`), ``FluxKontextPipeline``
(the image's latent tokens appended to the sequence with position ids whose first
coordinate is 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compat import diffusers as compat
from pipeline.families.base import (count_blocks, embedded_guidance, linear_guidance, load_pipeline, parameter_bytes,
                                    pixel_tensor, repaint_mask, run_vae, strength_timesteps, tokenizer_special_tokens,
                                    vae_config)
from pipeline.modes import DualMode, GuidanceMode, InputMode


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


@dataclass
class FluxImageInputs:
    """Position ids and image conditioning of B samples (what ``predict`` and ``after_step``
    take as ``positions`` for image inputs).

    img_ids: (S [+ S_ref], 3) rotary ids, the reference tokens' after the sample's. reference:
    (B, S_ref, 4·C) packed reference latents (Kontext) or None. image_latents, noise, mask:
    (B, S, 4·C) packed, for inpainting (None otherwise): the image's latents, the initial noise
    and 1 where the image is repainted.
    """

    img_ids: torch.Tensor
    reference: torch.Tensor | None = None
    image_latents: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def to(self, device) -> "FluxImageInputs":
        move = {k: None if v is None else v.to(device) for k, v in self.__dict__.items()}
        return FluxImageInputs(**move)


class FluxFamily:
    """Adapter over a loaded ``diffusers.FluxPipeline`` (its modules, scheduler config, helpers).

    ``vae_scale_factor``: pixels per latent pixel, from the VAE's config (also when the VAE is
    not loaded: ``components="denoiser"``). Serves text-to-image, image-to-image and inpainting.
    """

    family = "flux"
    pipeline_classes = ("FluxPipeline",)
    input_modes = (InputMode.IMAGE_TO_IMAGE, InputMode.INPAINT)
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
    longest_block_list = 0  # cache-dit's FLUX adapter caches both lists as one (CACHE_DIT_FLUX_ENABLE_DUMMY_BLOCKS)
    dual_mode = DualMode.SINGLE
    boundary_ratio = None
    guidance_style = GuidanceMode.TRUE_CFG  # guidance embedding + diffusers' true CFG on a negative prompt
    temporal_factor = 0                     # images only

    def __init__(self, pipe, vae_scale_factor: int):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.device = pipe.transformer.device
        self.dtype = self.prediction_dtype = pipe.transformer.dtype
        self.vae_scale_factor = vae_scale_factor
        # FluxPipeline caps T5 at 512 tokens; a checkpoint may ship a shorter tokenizer.
        self.max_sequence_length = min(512, int(pipe.tokenizer_2.model_max_length))

    @classmethod
    def from_pretrained(cls, path, *, torch_dtype=torch.float32, device="cpu", components: str = "all",
                        vae_slicing: bool = False) -> "FluxFamily":
        import diffusers
        from diffusers import AutoencoderKL

        pipe = load_pipeline(getattr(diffusers, cls.pipeline_classes[0]), path, torch_dtype=torch_dtype,
                             device=device, components=components,
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
        """Shard the transformer's sequence across the replica's ranks (``parallel.flux``). Raises
        ``ValueError`` when the padded T5 text cannot split evenly (the ``_cp_plan`` splits it too)."""
        from parallel.flux import enable_sequence_parallel

        if self.max_sequence_length % config.world_size:
            raise ValueError(f"FLUX.1's {self.max_sequence_length} text tokens cannot split evenly across "
                             f"world_size={config.world_size} ranks")
        enable_sequence_parallel(self.transformer, config, mesh, rank)

    # -- one batch ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images=None) -> FluxConditioning:
        """Encode B prompts with CLIP (pooled) and T5 (padded to ``max_sequence_length``)."""
        prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length)
        return FluxConditioning(prompt_embeds, pooled, text_ids)

    def prepare_latents(self, generators: list[torch.Generator], counts: list[int], params, requests=None,
                        schedule=None):
        """Initial latents, one generator per request drawing that request's ``count`` samples,
        at ``params.width`` × ``params.height`` pixels.

        Returns latents: (B, (h/2)·(w/2), 4·C) packed, dtype of the transformer, with
        B = sum(counts) and h, w the latent size; and img_ids: ((h/2)·(w/2), 3) for text, or
        :class:`FluxImageInputs` for image inputs (``requests``' images; ``schedule``'s first
        timestep for image-to-image and inpainting). Raises ``ValueError`` for an input mode
        this class does not serve (``input_modes``).
        """
        from diffusers.utils.torch_utils import randn_tensor

        height, width = params.height, params.width
        channels = self.transformer.config.in_channels // 4
        h = 2 * (int(height) // (self.vae_scale_factor * 2))
        w = 2 * (int(width) // (self.vae_scale_factor * 2))
        mode = params.input_mode
        noise, image_latents, masks, references = [], [], [], []
        for i, (g, count) in enumerate(zip(generators, counts, strict=True)):
            if mode in (InputMode.IMAGE_TO_IMAGE, InputMode.INPAINT):  # the VAE sample draws before the noise
                image_latents.append(self._encode_image(requests[i].images[0], g).expand(count, -1, -1, -1))
            elif mode == InputMode.REFERENCE:
                references.append(self._encode_image(requests[i].images[0], None).expand(count, -1, -1, -1))
            noise.append(randn_tensor((count, channels, h, w), generator=g, device=self.device, dtype=self.dtype))
            if mode == InputMode.INPAINT:
                mask = torch.nn.functional.interpolate(repaint_mask(requests[i].mask, self.device, self.dtype),
                                                       size=(h, w))
                masks.append(mask.expand(count, channels, -1, -1))
        noise = torch.cat(noise)
        batch = noise.shape[0]
        img_ids = compat.flux_latent_image_ids(batch, h // 2, w // 2, self.device, self.dtype)
        if mode == InputMode.TEXT:
            return compat.flux_pack_latents(noise, batch, channels, h, w), img_ids
        if mode == InputMode.REFERENCE:
            reference = torch.cat(references)
            ref_ids = compat.flux_latent_image_ids(batch, reference.shape[2] // 2, reference.shape[3] // 2,
                                                   self.device, self.dtype)
            ref_ids[..., 0] = 1  # FluxKontextPipeline: the reference's ids differ from the sample's in coordinate 0
            packed = compat.flux_pack_latents(reference, batch, channels, reference.shape[2], reference.shape[3])
            return (compat.flux_pack_latents(noise, batch, channels, h, w),
                    FluxImageInputs(torch.cat([img_ids, ref_ids]), reference=packed))
        if mode not in self.input_modes:
            raise ValueError(f"{type(self).__name__} does not serve {mode}")
        image = torch.cat(image_latents)
        start = schedule.timesteps[:1].repeat(batch)
        latents = schedule.scheduler.scale_noise(image, start, noise)
        pack = lambda x: compat.flux_pack_latents(x, batch, channels, h, w)  # noqa: E731
        if mode == InputMode.IMAGE_TO_IMAGE:
            return pack(latents), FluxImageInputs(img_ids)
        return pack(latents), FluxImageInputs(img_ids, image_latents=pack(image), noise=pack(noise),
                                              mask=pack(torch.cat(masks)))

    def _encode_image(self, image, generator: torch.Generator | None) -> torch.Tensor:
        """One RGB image → its scaled VAE latents (1, C, h, w): a sample drawn from ``generator``
        (image-to-image, inpainting), or the distribution's mode when ``generator`` is None
        (Kontext's ``sample_mode="argmax"``)."""
        vae = self.pipe.vae
        pixels = pixel_tensor([image], self.device, self.dtype)
        dist = vae.encode(pixels.to(vae.dtype)).latent_dist
        latents = dist.mode() if generator is None else dist.sample(generator)
        return ((latents - vae.config.shift_factor) * vae.config.scaling_factor).to(self.dtype)

    combine_guidance = staticmethod(linear_guidance)

    @staticmethod
    def select_positions(positions, index: torch.Tensor):
        """img_ids are shared by every sample; image inputs' per-sample latents are indexed."""
        if not isinstance(positions, FluxImageInputs):
            return positions
        rows = [None if x is None else x[index] for x in (positions.reference, positions.image_latents,
                                                           positions.noise, positions.mask)]
        return FluxImageInputs(positions.img_ids, *rows)

    def after_step(self, latents, positions, step_index: int, scheduler, timesteps):
        """Inpainting (``FluxInpaintPipeline``): the unmasked region takes the image's latents
        re-noised to the next timestep (the image itself after the last step)."""
        if not isinstance(positions, FluxImageInputs) or positions.mask is None:
            return latents
        image = positions.image_latents
        if step_index < len(timesteps) - 1:
            image = scheduler.scale_noise(image, torch.tensor([timesteps[step_index + 1]]), positions.noise)
        return (1 - positions.mask) * image + positions.mask * latents

    def scheduler_and_timesteps(self, num_inference_steps: int, params):
        """A fresh flow-matching scheduler for this batch and its timesteps (FLUX sigmas and
        shift ``mu`` from the image's packed sequence length, as ``FluxPipeline``); with
        ``params.strength`` only the last ``params.effective_steps`` of them, the scheduler
        started there (``FluxImg2ImgPipeline.get_timesteps``)."""
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
        return scheduler, strength_timesteps(scheduler, timesteps, num_inference_steps, params.strength)

    def guidance(self, embedded_guidance_scale: float | None, batch: int) -> torch.Tensor | None:
        """FLUX.1-dev's distilled guidance input: (B,) float32, or None without guidance embedding."""
        return embedded_guidance(self.guidance_embeds, embedded_guidance_scale, batch, self.device)

    @torch.no_grad()
    def predict(self, latents, t, cond: FluxConditioning, guidance, positions, *, model: str = "transformer",
                branch: str = "cond"):
        """One transformer call: latents (B, S, 4·C) → velocity (B, S, 4·C). ``model`` is
        always ``"transformer"`` (FLUX.1 has one); ``positions`` are the img_ids or
        :class:`FluxImageInputs` (Kontext: the reference tokens join the sequence, and only the
        sample's S tokens of the output are kept)."""
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        img_ids, hidden, reference = positions, latents, None
        if isinstance(positions, FluxImageInputs):
            img_ids, reference = positions.img_ids, positions.reference
        if reference is not None:
            hidden = torch.cat([latents, reference.to(latents.dtype)], dim=1)
        with self.transformer.cache_context(branch):
            out = self.transformer(
                hidden_states=hidden, timestep=timestep / 1000, guidance=guidance,
                pooled_projections=cond.pooled, encoder_hidden_states=cond.prompt_embeds,
                txt_ids=cond.text_ids, img_ids=img_ids, joint_attention_kwargs={}, return_dict=False)[0]
        return out if reference is None else out[:, :latents.shape[1]]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, params, vae_decode=None) -> np.ndarray | None:
        """Packed latents (B, S, 4·C) → images (B, params.height, params.width, 3) float32 in [0, 1]."""
        vae = self.pipe.vae
        latents = compat.flux_unpack_latents(latents, params.height, params.width, self.vae_scale_factor)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = run_vae(vae, latents.to(vae.dtype), vae_decode)
        if image is None:  # a rank that shares a parallel decode without gathering it
            return None
        return self.pipe.image_processor.postprocess(image, output_type="np")

    def decode_preview(self, latents: torch.Tensor, params) -> np.ndarray:
        """Previews are decoded as the final image."""
        return self.decode(latents, params)


class FluxKontextFamily(FluxFamily):
    """FLUX.1 Kontext checkpoints (``FluxKontextPipeline``): reference editing, the reference
    image's latent tokens concatenated to the sequence; text-to-image without an image."""

    family = "flux-kontext"
    pipeline_classes = ("FluxKontextPipeline",)
    input_modes = (InputMode.REFERENCE,)
