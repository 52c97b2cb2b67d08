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

from pipeline.modes import DualMode, GuidanceMode


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
    dual_mode: DualMode
    guidance_style: GuidanceMode            # the mode a guided request of this model runs
    guidance_embeds: bool                   # takes an embedded (distilled) guidance scale
    boundary_ratio: float | None            # boundary experts: the model's default ratio
    max_sequence_length: int                # text tokens per prompt (L)

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

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Encode B prompts (one per sample) with the family's text encoder(s), padded to L."""

    def prepare_latents(self, generators: list[torch.Generator], counts: list[int],
                        params) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Initial noise: generator ``i`` draws ``counts[i]`` samples (one generator per
        request, as diffusers draws them), at ``params.width`` × ``params.height`` pixels and
        ``params.num_frames`` frames. Returns ``(latents, positions)``: latents with a leading
        B = sum(counts) in the layout ``predict`` takes, positions the family's position ids
        (or None)."""

    def scheduler_and_timesteps(self, num_inference_steps: int, params) -> tuple[Any, torch.Tensor]:
        """A fresh scheduler for one batch of ``params``' size and its timesteps
        ((num_inference_steps,) float32, the values the transformer is called with)."""

    def guidance(self, embedded_guidance_scale: float | None, batch: int) -> torch.Tensor | None:
        """The embedded guidance input (B,) float32, or None when the model has none."""

    def predict(self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance: torch.Tensor | None,
                positions: torch.Tensor | None, *, model: str = "transformer", branch: str = "cond") -> torch.Tensor:
        """One call of transformer ``model`` at timestep ``t`` (0-dim): latents → its
        prediction, same shape as ``latents``. ``branch`` names cache-dit's context
        (``"cond"``/``"uncond"``)."""

    def decode(self, latents: torch.Tensor, params) -> np.ndarray:
        """Final latents → float32 pixels in [0, 1]: (B, H, W, 3) for images, (B, F, H, W, 3)
        for videos."""

    def enable_sequence_parallel(self, config, mesh, rank: int) -> None:
        """Shard every transformer's sequence across the ranks of ``mesh`` (``parallel/``)."""

    def parameter_bytes(self) -> int:
        """Bytes of the weights (parameters and buffers) this process has loaded."""


COMPONENTS = ("all", "denoiser")


def load_pipeline(pipeline_cls, path, *, torch_dtype: torch.dtype, device: str, components: str = "all",
                  encoders: tuple[str, ...] = (), vae_cls=None, vae_dtype: torch.dtype | None = None,
                  vae_slicing: bool = False):
    """A diffusers pipeline loaded straight onto ``device`` with diffusers' ``device_map``
    (each component goes from the checkpoint to the device, so host memory never holds the
    whole pipeline). ``components="denoiser"`` leaves out ``encoders`` (the text encoders and
    the VAE, by component name). ``vae_cls``/``vae_dtype``: load the VAE in its own dtype
    (Wan's VAE in float32, as diffusers' Wan examples do). Raises ``ValueError`` for an
    unknown ``components``."""
    if components not in COMPONENTS:
        raise ValueError(f"components must be one of {', '.join(COMPONENTS)}, got {components!r}")
    target = torch.device(device)
    if target.type == "cuda" and target.index is not None:
        torch.cuda.set_device(target)  # diffusers' device_map takes "cuda": the current device
    kwargs: dict[str, Any] = {name: None for name in encoders} if components == "denoiser" else {}
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
    """Bytes of every parameter and buffer of the pipeline's loaded modules."""
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))


def tokenizer_special_tokens(*tokenizers) -> tuple[str, ...]:
    """The sorted special-token strings of ``tokenizers`` (None entries skipped)."""
    return tuple(sorted({t for tok in tokenizers if tok is not None for t in tok.all_special_tokens}))


def count_blocks(transformer: torch.nn.Module) -> int:
    """Blocks cache-dit sees in a diffusers DiT: its ``transformer_blocks``,
    ``single_transformer_blocks`` and ``blocks`` lists together."""
    return sum(len(getattr(transformer, name, ())) for name in ("transformer_blocks", "single_transformer_blocks",
                                                                "blocks"))
