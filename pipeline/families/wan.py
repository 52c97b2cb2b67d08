"""Wan 2.1 / 2.2 family: UMT5 prompt encoding, 5-D video latents, one or two transformers,
``AutoencoderKLWan`` decode.

Mirrors diffusers' ``WanPipeline`` (same helpers, same order of random draws, float32
latents, the scheduler stepping in float32) so our loop reproduces its output exactly; the
loop itself, including the boundary-expert and paired-per-step modes, lives in
``pipeline.loop``. Image-to-video follows ``WanImageToVideoPipeline`` with
``expand_timesteps`` (Wan 2.2 TI2V's latent conditioning): the image's VAE latents replace
the first latent frame of the model's input at every step, whose tokens get timestep 0, and
of the final latents.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compat import diffusers as compat
from pipeline.families import model_index
from pipeline.families.base import (count_blocks, linear_guidance, load_pipeline, parameter_bytes, pixel_tensor,
                                    run_vae, tokenizer_special_tokens, vae_config)
from pipeline.modes import DualMode, GuidanceMode, InputMode


@dataclass
class WanConditioning:
    """Text conditioning of B samples: prompt_embeds (B, L, text_dim) UMT5 states, zeroed
    past each prompt's length, in the transformer's dtype."""

    prompt_embeds: torch.Tensor

    def select(self, index: torch.Tensor) -> "WanConditioning":
        return WanConditioning(self.prompt_embeds[index])

    def to(self, device) -> "WanConditioning":
        return WanConditioning(self.prompt_embeds.to(device))


@dataclass
class WanImageInputs:
    """Image-to-video conditioning of B samples: ``condition`` (B, z_dim, 1, h, w) float32, the
    normalised VAE latents of the first frame; ``mask`` (1, 1, T, h, w) float32, 0 on the first
    latent frame and 1 elsewhere (``WanImageToVideoPipeline``'s ``first_frame_mask``)."""

    condition: torch.Tensor
    mask: torch.Tensor

    def to(self, device) -> "WanImageInputs":
        return WanImageInputs(self.condition.to(device), self.mask.to(device))


class WanFamily:
    """Adapter over a loaded ``diffusers.WanPipeline``.

    ``dual_mode``: ``SINGLE`` (one transformer, Wan 2.1), ``BOUNDARY`` (the pipeline's
    ``boundary_ratio`` is set: Wan 2.2 A14B experts) or ``PAIRED`` (declared by the
    checkpoint's ``ditserve.json`` ``{"dual_transformer": "paired"}`` or the serve config's
    ``model.dual_transformer``). Raises ``ValueError`` when the mode needs a
    ``transformer_2`` the checkpoint lacks. The VAE runs in float32 whatever the transformers'
    dtype (as diffusers' Wan examples load it); its scale factors come from its config, also
    when it is not loaded (``components="denoiser"``).
    """

    family = "wan"
    pipeline_classes = ("WanPipeline", "WanImageToVideoPipeline")
    guidance_embeds = False
    max_input_images = 1
    cfg_threshold = 1.0  # WanPipeline: guidance_scale > 1 runs the unconditional forward
    masked_attention = False
    min_steps = 1
    true_cfg_default = 1.0  # the pipeline's default true_cfg_scale
    sequence_multiple = 1  # its latent tokens are split as they are
    requires_image = False  # text alone generates
    max_aspect_ratio = 0.0  # any
    longest_block_list = 0  # cache-dit caches one list per transformer: num_blocks

    def __init__(self, pipe, vae: dict, dual_transformer: str | None = None):
        self.pipe = pipe
        # WanImageToVideoPipeline with expand_timesteps (Wan 2.2 TI2V): image-to-video by latent conditioning
        self.input_modes = (InputMode.IMAGE_TO_VIDEO,) if pipe.config.get("expand_timesteps") else ()
        self.vae_scale_factor_spatial = int(vae["scale_factor_spatial"])
        self.vae_scale_factor_temporal = int(vae["scale_factor_temporal"])
        self.transformer = pipe.transformer
        self.transformer_2 = pipe.transformer_2
        self.device = pipe.transformer.device
        self.dtype = self.prediction_dtype = pipe.transformer.dtype
        self.max_sequence_length = min(512, int(pipe.tokenizer.model_max_length))
        self.boundary_ratio = pipe.config.boundary_ratio
        if dual_transformer not in (None, DualMode.BOUNDARY, DualMode.PAIRED):
            raise ValueError(f"dual_transformer must be 'boundary' or 'paired', got {dual_transformer!r}")
        mode = DualMode(dual_transformer or (DualMode.BOUNDARY if self.boundary_ratio is not None
                                             else DualMode.SINGLE))
        if mode != DualMode.SINGLE and self.transformer_2 is None:
            raise ValueError(f"dual_transformer={mode.value!r} needs a checkpoint with transformer_2")
        if mode == DualMode.BOUNDARY and self.boundary_ratio is None:
            raise ValueError("dual_transformer='boundary' needs the pipeline's boundary_ratio")
        self.dual_mode = mode
        # WanPipeline: guidance_scale > 1 runs a separate unconditional forward; paired: the second transformer guides
        self.guidance_style = GuidanceMode.AUTOGUIDANCE if mode == DualMode.PAIRED else GuidanceMode.CFG

    @classmethod
    def from_pretrained(cls, path, *, torch_dtype=torch.float32, device="cpu", components: str = "all",
                        vae_slicing: bool = False, dual_transformer: str | None = None) -> "WanFamily":
        """:meth:`ModelFamily.from_pretrained`; ``dual_transformer`` None reads the checkpoint's
        ``ditserve.json``. Raises ``ValueError`` for a Wan 2.1-style ``WanImageToVideoPipeline``
        (CLIP image encoder, no ``expand_timesteps``), an unknown ``components``, and as
        :class:`WanFamily` does for a ``dual_transformer`` the checkpoint cannot run."""
        import diffusers
        from diffusers import AutoencoderKLWan

        sidecar = Path(path) / "ditserve.json"
        if dual_transformer is None and sidecar.exists():
            dual_transformer = json.loads(sidecar.read_text()).get("dual_transformer")
        config = model_index(path)
        class_name = config["_class_name"]
        if class_name == "WanImageToVideoPipeline":
            if not config.get("expand_timesteps") or (config.get("image_encoder") or [None])[0] is not None:
                raise ValueError("Wan 2.1-style image-to-video (CLIP image encoder, channel-concatenated "
                                 "condition) is not served; Wan 2.2-style latent conditioning (expand_timesteps, "
                                 "no image encoder) is")
        pipe = load_pipeline(getattr(diffusers, class_name if class_name in cls.pipeline_classes else "WanPipeline"),
                             path, torch_dtype=torch_dtype, device=device, components=components,
                             encoders=("text_encoder", "vae"), vae_cls=AutoencoderKLWan, vae_dtype=torch.float32,
                             vae_slicing=vae_slicing)
        return cls(pipe, vae_config(pipe, path, AutoencoderKLWan), dual_transformer)

    def parameter_bytes(self) -> int:
        return parameter_bytes(self.pipe)

    # -- static facts the ingress validates against -------------------------------------
    @property
    def spatial_factor(self) -> int:
        """Width and height must be multiples of this (pixels): VAE factor × patch size."""
        return self.vae_scale_factor_spatial * int(self.transformer.config.patch_size[1])

    @property
    def temporal_factor(self) -> int:
        """num_frames must be ``temporal_factor · k + 1`` (Wan's VAE: 4)."""
        return int(self.vae_scale_factor_temporal)

    @property
    def max_side(self) -> int:
        """The widest or tallest output in pixels: ``WanRotaryPosEmbed`` tables
        ``rope_max_seq_len`` positions per axis (a side past them failed the batch)."""
        return int(self.transformer.config.rope_max_seq_len) * self.spatial_factor

    @property
    def max_latent_frames(self) -> int:
        """Latent frames ``WanRotaryPosEmbed``'s table covers (``rope_max_seq_len``)."""
        return int(self.transformer.config.rope_max_seq_len)

    @property
    def transformers(self) -> dict[str, torch.nn.Module]:
        """The transformers this model runs: ``transformer`` and, in a dual mode, ``transformer_2``."""
        out = {"transformer": self.transformer}
        if self.dual_mode != DualMode.SINGLE:
            out["transformer_2"] = self.transformer_2
        return out

    @property
    def num_attention_heads(self) -> int:
        return int(self.transformer.config.num_attention_heads)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return tokenizer_special_tokens(self.pipe.tokenizer)

    @property
    def num_blocks(self) -> int:
        """Blocks of the shallowest transformer (both experts of Wan 2.2 have the same depth)."""
        return min(count_blocks(t) for t in self.transformers.values())

    def latent_frames(self, num_frames: int) -> int:
        """Latent frames of ``num_frames`` video frames: ``(num_frames − 1) // temporal_factor + 1``."""
        return (num_frames - 1) // self.temporal_factor + 1

    def sequence_lengths(self, width: int, height: int, num_frames: int = 1) -> dict[str, int]:
        """Tokens per sample: latent frames × patches per frame, and UMT5 text tokens."""
        f = self.spatial_factor
        return {"image tokens": self.latent_frames(num_frames) * (height // f) * (width // f),
                "text tokens": self.max_sequence_length}

    def enable_sequence_parallel(self, config, mesh, rank: int) -> None:
        """Shard every transformer's sequence across the replica's ranks (``parallel.wan``)."""
        from parallel.wan import enable_sequence_parallel

        for transformer in self.transformers.values():
            enable_sequence_parallel(transformer, config, mesh, rank)

    # -- one batch ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images=None) -> WanConditioning:
        """Encode B prompts with UMT5, padded to ``max_sequence_length`` (as ``WanPipeline``)."""
        embeds = compat.wan_prompt_embeds(self.pipe, prompts, self.max_sequence_length, self.device)
        return WanConditioning(embeds.to(self.dtype))

    def prepare_latents(self, generators: list[torch.Generator], counts: list[int], params, requests=None,
                        schedule=None):
        """Initial noise (B, in_channels, latent frames, height/s, width/s) float32 (``s``: the
        VAE's ``scale_factor_spatial``, 8 for Wan 2.1, 16 for Wan 2.2 TI2V), one generator
        per request drawing that request's ``count`` samples; Wan needs no position ids, so
        ``positions`` is None, or :class:`WanImageInputs` for image-to-video (``requests``'
        first images, encoded after the noise is drawn, as ``WanImageToVideoPipeline``).
        Raises ``ValueError`` for an image input this checkpoint does not serve."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (self.transformer.config.in_channels, self.latent_frames(params.num_frames),
                 params.height // self.vae_scale_factor_spatial, params.width // self.vae_scale_factor_spatial)
        noise = [randn_tensor((count, *shape), generator=g, device=self.device, dtype=torch.float32)
                 for g, count in zip(generators, counts, strict=True)]
        if params.input_mode == InputMode.TEXT:
            return torch.cat(noise), None
        if params.input_mode not in self.input_modes:
            raise ValueError(f"this Wan checkpoint does not serve {params.input_mode}")
        condition = torch.cat([self._encode_first_frame(p.images[0]).expand(count, -1, -1, -1, -1)
                               for p, count in zip(requests, counts, strict=True)])
        mask = torch.ones(1, 1, *shape[1:], dtype=torch.float32, device=self.device)
        mask[:, :, 0] = 0
        return torch.cat(noise), WanImageInputs(condition, mask)

    @torch.no_grad()
    def _encode_first_frame(self, image) -> torch.Tensor:
        """One RGB image → its normalised VAE latents as one latent frame (1, z_dim, 1, h, w)
        float32 (the distribution's mode: ``sample_mode="argmax"``)."""
        vae = self.pipe.vae
        pixels = pixel_tensor([image], self.device, torch.float32).unsqueeze(2)
        latents = vae.encode(pixels.to(vae.dtype)).latent_dist.mode().to(torch.float32)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents)
        return (latents - mean) * inv_std

    combine_guidance = staticmethod(linear_guidance)

    @staticmethod
    def select_positions(positions, index: torch.Tensor):
        """None for text-to-video; image-to-video's conditions of samples ``index``."""
        if positions is None:
            return None
        return WanImageInputs(positions.condition[index], positions.mask)

    def after_step(self, latents, positions, step_index: int, scheduler, timesteps):
        """Image-to-video: after the last step the first latent frame is the image's."""
        if not isinstance(positions, WanImageInputs) or step_index < len(timesteps) - 1:
            return latents
        return (1 - positions.mask) * positions.condition + positions.mask * latents

    def scheduler_and_timesteps(self, num_inference_steps: int, params=None):
        """A fresh copy of the checkpoint's scheduler (UniPC flow prediction for Wan) and its
        timesteps, (num_inference_steps,) int64 for UniPC."""
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        scheduler.set_timesteps(num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    def guidance(self, embedded_guidance_scale: float | None, batch: int) -> None:
        """Wan has no guidance embedding: always None."""

    @torch.no_grad()
    def predict(self, latents, t, cond: WanConditioning, guidance, positions, *, model: str = "transformer",
                branch: str = "cond"):
        """One call of transformer ``model``: latents (B, C, T, h, w) → flow (B, C, T, h, w).
        Image-to-video (``positions`` a :class:`WanImageInputs`): the first latent frame is the
        image's and its tokens get timestep 0 (a (B, S) timestep, Wan 2.2 TI2V)."""
        transformer = self.transformers[model]
        timestep = t.expand(latents.shape[0])
        if isinstance(positions, WanImageInputs):
            mask = positions.mask
            latents = (1 - mask) * positions.condition + mask * latents
            _, p_h, p_w = transformer.config.patch_size
            timestep = (mask[0][0][:, ::p_h, ::p_w] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)
        x = latents.to(self.dtype)
        with transformer.cache_context(branch):
            return transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=cond.prompt_embeds,
                               return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, params, vae_decode=None) -> np.ndarray | None:
        """Latents → videos (B, num_frames, height, width, 3) float32 in [0, 1]."""
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents)
        video = run_vae(vae, latents / inv_std + mean, vae_decode)
        if video is None:  # a rank that shares a parallel decode without gathering it
            return None
        return self.pipe.video_processor.postprocess_video(video, output_type="np")

    def decode_preview(self, latents: torch.Tensor, params) -> np.ndarray:
        """The first frame of each video, (B, height, width, 3) float32 in [0, 1]: Wan's VAE is
        causal in time, so the first latent frame decodes to the first frame alone (a fraction of
        the whole decode)."""
        return self.decode(latents[:, :, :1], params)[:, 0]
