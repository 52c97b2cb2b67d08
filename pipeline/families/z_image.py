"""Z-Image family: Qwen3 prompt encoding (second-to-last hidden states, each prompt's own length),
unpacked latents, one single-stream DiT step over per-sample lists, VAE decode.

Mirrors diffusers' ``ZImagePipeline`` (its public ``encode_prompt`` and ``prepare_latents``, the
same order of random draws, FLUX-style ``mu`` on Z-Image's sigmas) so our loop reproduces its
output; the loop itself lives in ``pipeline.loop``. Guidance is CFG on a negative prompt
(default ``""``) whenever ``guidance_scale`` > 0 (Z-Image Turbo runs with 0), combined as
``cond + scale · (cond − guide)`` (:meth:`ZImageFamily.combine_guidance`). The transformer
predicts the negated velocity at ``(1000 − t) / 1000``; ``predict`` returns the velocity.

Sequence parallelism: diffusers ships no ``_cp_plan`` for ``ZImageTransformer2DModel`` (its
unified image + caption sequence is built inside the forward), so a multi-rank replica refuses
this family at startup.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.families.base import (load_pipeline, parameter_bytes, run_vae, shared_positions,
                                    tokenizer_special_tokens, unchanged_latents, vae_config)
from pipeline.modes import DualMode, GuidanceMode


@dataclass
class ZImageConditioning:
    """Text conditioning of B samples: ``prompt_embeds``, one (L_i, hidden) tensor per sample
    (each prompt's own length, no padding; the transformer pads them itself)."""

    prompt_embeds: list[torch.Tensor]

    def select(self, index: torch.Tensor) -> "ZImageConditioning":
        return ZImageConditioning([self.prompt_embeds[int(i)] for i in index])

    def to(self, device) -> "ZImageConditioning":
        return ZImageConditioning([e.to(device) for e in self.prompt_embeds])


class ZImageFamily:
    """Adapter over a loaded ``diffusers.ZImagePipeline``. ``vae_scale_factor``: pixels per
    latent pixel (from the VAE config, also when it is not loaded)."""

    family = "z-image"
    pipeline_classes = ("ZImagePipeline",)
    dual_mode = DualMode.SINGLE
    boundary_ratio = None
    guidance_style = GuidanceMode.CFG
    guidance_embeds = False
    temporal_factor = 0
    input_modes = ()
    max_input_images = 1
    cfg_threshold = 0.0  # ZImagePipeline.do_classifier_free_guidance: guidance_scale > 0
    masked_attention = True  # the transformer pads captions of a batch to a common length, masked
    min_steps = 1
    true_cfg_default = 1.0  # the pipeline's default true_cfg_scale
    sequence_multiple = 32  # diffusers' SEQ_MULTI_OF: the unified sequence is padded to it
    requires_image = False  # text alone generates
    max_latent_frames = 0  # an image model
    max_aspect_ratio = 0.0  # any
    longest_block_list = 0  # cache-dit caches one list (layers): num_blocks
    patch_size = 2

    def __init__(self, pipe, vae_scale_factor: int):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.device = pipe.transformer.device
        self.dtype = pipe.transformer.dtype
        self.prediction_dtype = torch.float32  # predict upcasts, as ZImagePipeline does
        self.vae_scale_factor = vae_scale_factor
        pipe.vae_scale_factor = vae_scale_factor  # the pipeline's is 8 without a loaded VAE
        self.max_sequence_length = min(512, int(pipe.tokenizer.model_max_length))

    @classmethod
    def from_pretrained(cls, path, *, torch_dtype=torch.float32, device="cpu", components: str = "all",
                        vae_slicing: bool = False) -> "ZImageFamily":
        from diffusers import AutoencoderKL, ZImagePipeline

        pipe = load_pipeline(ZImagePipeline, path, torch_dtype=torch_dtype, device=device, components=components,
                             encoders=("text_encoder", "vae"), vae_slicing=vae_slicing)
        factor = 2 ** (len(vae_config(pipe, path, AutoencoderKL)["block_out_channels"]) - 1)
        return cls(pipe, factor)

    def parameter_bytes(self) -> int:
        return parameter_bytes(self.pipe)

    # -- static facts the ingress validates against -------------------------------------
    @property
    def spatial_factor(self) -> int:
        """Width and height must be multiples of this (pixels): VAE factor × 2×2 patches."""
        return self.vae_scale_factor * self.patch_size

    @property
    def transformers(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.transformer}

    @property
    def num_attention_heads(self) -> int:
        return int(self.transformer.config.n_heads)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return tokenizer_special_tokens(self.pipe.tokenizer)

    @property
    def num_blocks(self) -> int:
        """The main single-stream layers (cache-dit's Z-Image adapter caches ``layers``)."""
        return len(self.transformer.layers)

    @property
    def max_side(self) -> int:
        """The widest or tallest output in pixels: its RoPE tables hold ``axes_lens[1]`` rows and
        ``axes_lens[2]`` columns of latent patches (diffusers' ``ZImageTransformer2DModel``; a
        side past them raised IndexError in the batch)."""
        _, rows, columns = self.transformer.config.axes_lens
        return int(min(rows, columns)) * self.spatial_factor

    def sequence_lengths(self, width: int, height: int, num_frames: int = 1) -> dict[str, int]:
        """Tokens per sample: 2×2 latent patches, and at most ``max_sequence_length`` text tokens."""
        return {"image tokens": (height // self.spatial_factor) * (width // self.spatial_factor),
                "text tokens": self.max_sequence_length}

    def enable_sequence_parallel(self, config, mesh, rank: int) -> None:
        """Shard the main layers' unified sequence across the sequence-parallel ranks with our own
        split hooks (``parallel.z_image``: diffusers has no ``_cp_plan`` for this transformer).
        Raises ``ValueError`` when ``ulysses_degree x ring_degree`` does not divide 32."""
        from parallel.z_image import enable_sequence_parallel

        enable_sequence_parallel(self.transformer, config, mesh, rank)

    # -- one batch ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images=None) -> ZImageConditioning:
        """Encode B prompts (``ZImagePipeline.encode_prompt``: chat template, Qwen3's
        second-to-last hidden states of each prompt's real tokens)."""
        embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                            do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length)
        return ZImageConditioning([e.to(self.dtype) for e in embeds])

    def prepare_latents(self, generators: list[torch.Generator], counts: list[int], params, requests=None,
                        schedule=None):
        """Initial noise (B, C, h, w) float32, one generator per request drawing its ``count``
        samples (``ZImagePipeline.prepare_latents``); no position ids."""
        channels = self.transformer.in_channels
        noise = [self.pipe.prepare_latents(count, channels, params.height, params.width, torch.float32, self.device, g)
                 for g, count in zip(generators, counts, strict=True)]
        return torch.cat(noise), None

    after_step = staticmethod(unchanged_latents)  # no image inputs
    select_positions = staticmethod(shared_positions)  # no position ids

    def scheduler_and_timesteps(self, num_inference_steps: int, params):
        """A fresh scheduler and its timesteps: Z-Image's sigmas ``linspace(1, 1/N, N)`` and
        FLUX-style ``mu`` from the patch count (``ZImagePipeline``)."""
        from diffusers.pipelines.z_image.pipeline_z_image import (calculate_shift, get_default_z_image_sigmas,
                                                                   retrieve_timesteps)

        image_seq_len = self.sequence_lengths(params.width, params.height)["image tokens"]
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        cfg = scheduler.config
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, self.device,
                                          sigmas=get_default_z_image_sigmas(num_inference_steps), mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    def guidance(self, embedded_guidance_scale: float | None, batch: int) -> None:
        """Z-Image has no guidance embedding: always None."""

    @staticmethod
    def combine_guidance(cond: torch.Tensor, guide: torch.Tensor, scale: float) -> torch.Tensor:
        """Z-Image's CFG: ``cond + scale · (cond − guide)`` (``ZImagePipeline``, no normalisation)."""
        return cond + scale * (cond - guide)

    @torch.no_grad()
    def predict(self, latents, t, cond: ZImageConditioning, guidance, positions, *, model: str = "transformer",
                branch: str = "cond"):
        """One transformer call: latents (B, C, h, w) → velocity (B, C, h, w) float32 (the model
        takes per-sample lists, timestep ``(1000 − t) / 1000``, and predicts the negated velocity).
        ``ZImagePipeline`` runs the conditional and unconditional rows in one forward; ours are two,
        as for every family (equal within float32 summation order)."""
        timestep = (1000 - t.expand(latents.shape[0])) / 1000
        samples = list(latents.to(self.dtype).unsqueeze(2).unbind(dim=0))
        # no diffusers CacheMixin here: cache-dit tells the two forwards of a step apart by their order
        out = self.transformer(samples, timestep, cond.prompt_embeds, return_dict=False)[0]
        return -torch.stack([o.float() for o in out], dim=0).squeeze(2)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, params, vae_decode=None) -> np.ndarray | None:
        """Latents (B, C, h, w) → images (B, params.height, params.width, 3) float32 in [0, 1]."""
        vae = self.pipe.vae
        x = (latents.to(vae.dtype) / vae.config.scaling_factor) + vae.config.shift_factor
        image = run_vae(vae, x, vae_decode)
        if image is None:  # a rank that shares a parallel decode without gathering it
            return None
        return self.pipe.image_processor.postprocess(image, output_type="np")

    def decode_preview(self, latents: torch.Tensor, params) -> np.ndarray:
        """Previews are decoded as the final image."""
        return self.decode(latents, params)
