"""The interface a model family provides to the loop, the runner and sequence parallelism.

A family adapts one diffusers pipeline class (``FluxPipeline``, ``WanPipeline``, ...): it
encodes prompts, shapes latents, calls its transformer(s) for one step and decodes. The
denoising loop itself is ours (``pipeline.loop``), so batching, guidance, CFG gating,
Cache-DiT and sequence sharding work the same for every family.

Adding a family: one module in ``pipeline/families/`` with a class that satisfies
:class:`ModelFamily`, one line in ``pipeline.families.REGISTRY``, and a tiny model in
``pipeline.tiny.registry`` so ``tests/test_family_conformance.py`` covers it.

Shapes below: ``B`` samples in the batch (a request with ``n`` counts ``n``), ``S`` latent
tokens per sample, ``L`` text tokens, ``H``/``W`` pixels, ``F`` frames.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from pipeline.modes import DualMode, GuidanceMode, InputMode


@runtime_checkable
class Conditioning(Protocol):
    """Encoded prompts of B samples, in the family's own layout (tensors with a leading B)."""

    def select(self, index: torch.Tensor) -> "Conditioning":
        """Rows ``index`` (an int64 tensor of sample indices), e.g. to repeat a request's
        prompt for each of its ``n`` samples."""

    def to(self, device: torch.device | str) -> "Conditioning":
        """The same conditioning on ``device`` (rank 0 encodes and sends it to the others)."""


@runtime_checkable
class ModelFamily(Protocol):
    """What ``pipeline.loop``, ``pipeline.runner`` and ``parallel/`` use of a model family."""

    family: ClassVar[str]                   # registry name, e.g. "flux"
    pipe: Any                               # the diffusers pipeline (LoRA files load through its loader mixin)
    pipeline_classes: ClassVar[tuple[str, ...]]  # diffusers pipeline class names it serves
    device: torch.device
    dtype: torch.dtype                      # the transformers' dtype
    # what ``predict`` returns: ``dtype``, or float32 where the diffusers pipeline upcasts the
    # transformer's output (Z-Image); the wire dtype of CFG parallelism's collectives (parallel.cfg)
    prediction_dtype: torch.dtype
    dual_mode: DualMode
    guidance_style: GuidanceMode            # the mode a guided request of this model runs
    guidance_embeds: bool                   # takes an embedded (distilled) guidance scale
    boundary_ratio: float | None            # boundary experts: the model's default ratio
    max_sequence_length: int                # text tokens per prompt (L)
    input_modes: tuple[InputMode, ...]      # what the checkpoint serves beyond text (image inputs)
    max_input_images: int                   # images one request may give
    cfg_threshold: float                    # CFG style: guided when guidance_scale exceeds it (Wan 1, Z-Image 0)
    masked_attention: bool                  # batches carry an attention mask (padded text): kernels must take one
    min_steps: int                          # the fewest num_inference_steps its scheduler runs correctly
    true_cfg_default: float                 # TRUE_CFG style: true_cfg_scale of a negative prompt given alone
    sequence_multiple: int                  # it pads a sample's split sequence to a multiple of this (1: none)
    requires_image: bool                    # serves edits only: every request gives an input image (Qwen-Image-Edit)
    max_side: int                           # the widest/tallest output its position table covers (pixels; 0: any)
    max_latent_frames: int                  # video: the latent frames its position table covers (0: any)
    max_aspect_ratio: float                 # the most elongated output it can take (long side / short; 0: any)
    longest_block_list: int                 # blocks of the longest list cache-dit caches (0: num_blocks)

    @classmethod
    def from_pretrained(cls, path: Any, *, torch_dtype: torch.dtype, device: str, components: str = "all",
                        vae_slicing: bool = False, **options) -> "ModelFamily":
        """Load a diffusers checkpoint directory onto ``device`` (:func:`load_pipeline`).
        ``components``: ``"all"``, or ``"denoiser"`` for the transformers alone (no text
        encoders, no VAE: sequence-parallel ranks other than 0, which neither encode nor
        decode). ``vae_slicing``: decode one sample at a time (bounded decode memory for
        large ``n``). ``options`` are family-specific (Wan: ``dual_transformer``). Raises
        ``ValueError`` when the checkpoint does not fit."""

    @property
    def transformers(self) -> dict[str, torch.nn.Module]:
        """The transformers a batch may run, by name: ``transformer`` and, for dual models,
        ``transformer_2``. Cache-DiT, kernel switches, torch.compile and sequence parallelism
        apply to each."""

    @property
    def spatial_factor(self) -> int:
        """Width and height must be multiples of this many pixels (VAE factor × patch size)."""

    @property
    def temporal_factor(self) -> int:
        """Video models take ``temporal_factor · k + 1`` frames; 0 for image models."""

    @property
    def num_attention_heads(self) -> int:
        """Attention heads per layer (Ulysses splits them across ranks)."""

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Every special-token string of the family's tokenizers (``</s>``, ``<|endoftext|>``):
        requests may not contain them (``pipeline.contract.text``)."""

    @property
    def num_blocks(self) -> int:
        """Transformer blocks cache-dit sees, the fewest over ``transformers`` (bounds
        ``Fn_compute_blocks + Bn_compute_blocks``)."""

    def sequence_lengths(self, width: int, height: int, num_frames: int = 1) -> dict[str, int]:
        """Tokens per sample the transformer sees: ``{"image tokens": S, "text tokens": L}``
        for a ``width`` × ``height`` pixel sample of ``num_frames`` frames."""

    def encode_prompts(self, prompts: list[str], images=None) -> Conditioning:
        """Encode B prompts (one per sample) with the family's text encoder(s), padded to L.
        ``images``: per prompt, its request's input images (a tuple of
        :class:`pipeline.wire.ImageArray`, empty for text); a family whose text encoder sees the
        image (Qwen-Image-Edit) conditions each prompt on them, the others ignore them."""

    def prepare_latents(self, generators: list[torch.Generator], counts: list[int], params, requests=None,
                        schedule=None) -> tuple[torch.Tensor, Any]:
        """Initial latents: generator ``i`` draws ``counts[i]`` samples (one generator per
        request, as diffusers draws them), at ``params.width`` × ``params.height`` pixels and
        ``params.num_frames`` frames. Returns ``(latents, positions)``: latents with a leading
        B = sum(counts) in the layout ``predict`` takes, positions the family's position ids
        (or None). With image inputs (``params.input_mode`` not ``TEXT``): ``requests`` are the
        batch's requests in generator order (their ``images`` / ``mask``), ``schedule`` the
        batch's ``pipeline.loop.BatchSchedule`` (the timestep to noise to); ``positions`` then
        also carry the image conditioning (opaque to the loop; has ``.to(device)``). A family
        with image inputs raises ``ValueError`` for an ``input_mode`` its checkpoint does not serve."""

    def combine_guidance(self, cond: torch.Tensor, guide: torch.Tensor, scale: float) -> torch.Tensor:
        """The guided prediction from the conditional and the guiding one (same shape):
        :func:`linear_guidance` for most families; a family whose pipeline rescales (Qwen-Image)
        says so here. CFG gating calls it with ``guide = cond − last delta``."""

    def after_step(self, latents: torch.Tensor, positions: Any, step_index: int, scheduler,
                   timesteps: torch.Tensor) -> torch.Tensor:
        """Latents after the scheduler's step ``step_index``, as the mode wants them: inpainting
        blends the re-noised unmasked region back, image-to-video its conditioned first frame
        after the last step; otherwise ``latents`` unchanged."""

    def select_positions(self, positions: Any, index: torch.Tensor) -> Any:
        """``positions`` of the sample rows ``index`` (an int64 tensor), as ``prepare_latents``
        makes them for those samples alone (CFG parallelism splits a batch's rows across its
        two groups): per-sample parts indexed, shared ones (FLUX's position ids) as they are."""

    def scheduler_and_timesteps(self, num_inference_steps: int, params) -> tuple[Any, torch.Tensor]:
        """A fresh scheduler for one batch of ``params``' size and its timesteps, the values the
        transformer is called with: 1-D, ``params.effective_steps`` long (all
        ``num_inference_steps`` without ``strength``); float32 for flow-matching schedulers
        (FLUX, Qwen-Image, Z-Image), int64 for Wan's ``UniPCMultistepScheduler``."""

    def guidance(self, embedded_guidance_scale: float | None, batch: int) -> torch.Tensor | None:
        """The embedded guidance input (B,) float32, or None when the model has none."""

    def predict(self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance: torch.Tensor | None,
                positions: torch.Tensor | None, *, model: str = "transformer", branch: str = "cond") -> torch.Tensor:
        """One call of transformer ``model`` at timestep ``t`` (0-dim): latents → its
        prediction, same shape as ``latents``. ``branch`` names cache-dit's context
        (``"cond"``/``"uncond"``)."""

    def decode(self, latents: torch.Tensor, params, vae_decode=None) -> np.ndarray | None:
        """Final latents → float32 pixels in [0, 1]: (B, H, W, 3) for images, (B, F, H, W, 3)
        for videos. ``vae_decode(vae, z)``: how the VAE turns its input ``z`` into pixels
        (:func:`run_vae`; a multi-rank replica passes a tile-parallel decode that gives None on
        ranks other than 0, and then ``decode`` returns None)."""

    def decode_preview(self, latents: torch.Tensor, params) -> np.ndarray:
        """A cheap look at ``decode``'s input for streamed previews: float32 (B, H, W, 3) in
        [0, 1] — images as ``decode`` gives them, a video its first frame only."""

    def enable_sequence_parallel(self, config, mesh, rank: int) -> None:
        """Shard every transformer's sequence across the ranks of ``mesh`` (``parallel/``)."""

    def parameter_bytes(self) -> int:
        """Bytes of the weights (parameters and buffers) this process has loaded."""


COMPONENTS = ("all", "denoiser", "denoiser+vae")


def run_vae(vae, z: torch.Tensor, vae_decode=None) -> torch.Tensor | None:
    """``vae.decode(z)``'s sample, or ``vae_decode(vae, z)`` when given (None on ranks that do
    not gather the result)."""
    if vae_decode is None:
        return vae.decode(z, return_dict=False)[0]
    return vae_decode(vae, z)


def linear_guidance(cond: torch.Tensor, guide: torch.Tensor, scale: float) -> torch.Tensor:
    """``guide + scale · (cond − guide)``: FLUX's true CFG and Wan's CFG (Ho & Salimans 2022,
    "Classifier-Free Diffusion Guidance", arXiv:2207.12598)."""
    return guide + scale * (cond - guide)


def embedded_guidance(enabled: bool, scale: float | None, batch: int, device) -> torch.Tensor | None:
    """A guidance-distilled model's guidance input (FLUX.1-dev, FLUX.2 [dev]): (B,) float32 of
    ``scale``, or None when the model has no guidance embedding or no scale is given."""
    if not enabled or scale is None:
        return None
    return torch.full([1], scale, device=device, dtype=torch.float32).expand(batch)


def unchanged_latents(latents: torch.Tensor, positions, step_index: int, scheduler, timesteps) -> torch.Tensor:
    """``ModelFamily.after_step`` of a family without image inputs: the latents as they are."""
    return latents


def shared_positions(positions, index: torch.Tensor):
    """``ModelFamily.select_positions`` of a family whose positions have no per-sample part
    (None, or ids every sample shares): ``positions`` unchanged."""
    return positions


def pixel_tensor(images, device, dtype) -> torch.Tensor:
    """:class:`pipeline.wire.ImageArray` RGB images (uint8, H × W pixels) → (B, 3, H, W) in
    [-1, 1], ``dtype`` on ``device``, as diffusers' ``VaeImageProcessor.preprocess`` makes them
    from PIL images (``/255``, then ``2x − 1``)."""
    pixels = np.stack([np.asarray(image.array(), dtype=np.float32) / 255.0 for image in images])
    return (2.0 * torch.from_numpy(pixels).permute(0, 3, 1, 2) - 1.0).to(device=device, dtype=dtype)


def repaint_mask(mask, device, dtype) -> torch.Tensor:
    """An OpenAI mask (its alpha, :class:`pipeline.wire.ImageArray` 1 channel) → diffusers' mask
    (1, 1, H, W) in ``dtype``: 1 where the image is repainted (alpha 0), 0 where it is kept,
    binarised at 0.5 as ``VaeImageProcessor(do_binarize=True)`` does."""
    repaint = (255.0 - np.asarray(mask.array(), dtype=np.float32)) / 255.0
    return (torch.from_numpy(repaint).permute(2, 0, 1)[None] >= 0.5).to(device=device, dtype=dtype)


def strength_timesteps(scheduler, timesteps: torch.Tensor, num_inference_steps: int, strength: float | None):
    """The timesteps an image-to-image run of ``strength`` takes: ``scheduler.timesteps`` without
    its first ``int(N − N·strength) · scheduler.order`` (N: ``num_inference_steps``), the
    scheduler's begin index set there (diffusers' ``get_timesteps`` of ``FluxImg2ImgPipeline``);
    ``timesteps`` unchanged without strength."""
    if strength is None:
        return timesteps
    init = min(num_inference_steps * strength, num_inference_steps)
    t_start = int(max(num_inference_steps - init, 0)) * scheduler.order
    scheduler.set_begin_index(t_start)
    return scheduler.timesteps[t_start:]


def load_pipeline(pipeline_cls, path, *, torch_dtype: torch.dtype, device: str, components: str = "all",
                  encoders: tuple[str, ...] = (), vae_cls=None, vae_dtype: torch.dtype | None = None,
                  vae_slicing: bool = False, given: dict[str, Any] | None = None):
    """A diffusers pipeline loaded straight onto ``device`` with diffusers' ``device_map``
    (each component goes from the checkpoint to the device, so host memory never holds the
    whole pipeline). ``components="denoiser"`` leaves out ``encoders`` (the text encoders and
    the VAE, by component name); ``"denoiser+vae"`` keeps the VAE (a multi-rank replica whose
    ranks share a tiled decode, ``parallel.vae``). ``vae_cls``/``vae_dtype``: load the VAE in its own dtype
    (Wan's VAE in float32, as diffusers' Wan examples do). Raises ``ValueError`` for an
    unknown ``components``. ``given``: components loaded by the family itself, by name
    (Qwen-Image-Edit's processor, ``compat.transformers``), used where they are kept."""
    if components not in COMPONENTS:
        raise ValueError(f"components must be one of {', '.join(COMPONENTS)}, got {components!r}")
    target = torch.device(device)
    if target.type == "cuda" and target.index is not None:
        torch.cuda.set_device(target)  # diffusers' device_map takes "cuda": the current device
    kept = {"all": set(encoders), "denoiser": set(), "denoiser+vae": {"vae"}}[components]
    kwargs: dict[str, Any] = {name: None for name in encoders if name not in kept}
    kwargs.update({name: module for name, module in (given or {}).items() if name not in kwargs})
    if vae_dtype is not None and "vae" not in kwargs:
        kwargs["vae"] = vae_cls.from_pretrained(str(path), subfolder="vae", dtype=vae_dtype, device_map=target.type)
    pipe = pipeline_cls.from_pretrained(str(path), dtype=torch_dtype, device_map=target.type, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    if vae_slicing and pipe.vae is not None:
        pipe.vae.enable_slicing()
    return pipe


def vae_config(pipe, path, vae_cls) -> dict:
    """The VAE's config: the loaded VAE's, or read from the checkpoint when it was left out."""
    vae = getattr(pipe, "vae", None)
    return dict(vae.config) if vae is not None else dict(vae_cls.load_config(str(path), subfolder="vae"))


def parameter_bytes(pipe) -> int:
    """Bytes of every parameter and buffer of the pipeline's loaded modules this process holds
    (a parameter sharded across ranks, a ``DTensor``, counts its local shard)."""
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    return sum(local(t).numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))


def tokenizer_special_tokens(*tokenizers) -> tuple[str, ...]:
    """The sorted special-token strings of ``tokenizers`` (None entries skipped; a processor,
    e.g. FLUX.2's PixtralProcessor, contributes its text tokenizer's)."""
    texts = [getattr(tok, "tokenizer", tok) for tok in tokenizers if tok is not None]  # a processor's tokenizer
    return tuple(sorted({t for tok in texts for t in tok.all_special_tokens}))


def count_blocks(transformer: torch.nn.Module) -> int:
    """Blocks cache-dit sees in a diffusers DiT: its ``transformer_blocks``,
    ``single_transformer_blocks`` and ``blocks`` lists together."""
    return sum(len(getattr(transformer, name, ())) for name in ("transformer_blocks", "single_transformer_blocks",
                                                                "blocks"))
