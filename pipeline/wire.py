"""What crosses a process boundary between the Ingress, the Router and the replicas (torch-free).

Router → replica: a :class:`Batch` of resolved requests. Replica → Router → Ingress: one
:class:`RequestOutput` per request. Replica → Ingress at start: :class:`ModelFacts`. What the
client finally sees of it is :class:`GenerationMetadata` (the response's ``ditserve`` block),
assembled in one place (:meth:`GenerationMetadata.of`). Nothing here imports torch or
diffusers, so the processes that only route never load them (``tests/test_architecture.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, model_serializer

from pipeline.contract.limits import ServingLimits, default_max_input_pixels, parse_size
from pipeline.modes import DualMode, GuidanceMode, InputMode

if TYPE_CHECKING:  # annotations only: the request models import this module's metadata types
    from pipeline.errors import DitServeError
    from pipeline.sampling import SamplingParams
    from pipeline.signature import BatchSignature


@dataclass(frozen=True)
class ImageArray:
    """A decoded input image, ready for tensors: ``pixels`` holds uint8 values row-major as
    (height, width, channels); ``channels`` 3 (RGB) for images, 1 for masks (OpenAI's alpha:
    0 marks the region to repaint). Decoded, checked and resized in the Ingress
    (``pipeline.contract.uploads``), so replicas never see an undecoded upload."""

    width: int
    height: int
    channels: int
    pixels: bytes = field(repr=False)

    def __post_init__(self):
        if len(self.pixels) != self.width * self.height * self.channels:
            raise ValueError(f"ImageArray: {len(self.pixels)} bytes for {self.width}x{self.height}x{self.channels}")

    def array(self):
        """The pixels as a read-only numpy array (height, width, channels) uint8."""
        import numpy as np

        return np.frombuffer(self.pixels, dtype=np.uint8).reshape(self.height, self.width, self.channels)


@dataclass(frozen=True)
class Batch:
    """What the Router sends a replica: requests of one signature, in queue order.

    ``preferred_replica``: the replica the Router meant it for (Serve's request router
    honours it when that replica is free). ``report_steps``: the replica streams a
    ``{"step", "steps"}`` event per denoising step (a request of the batch shows progress: a
    video job); otherwise it sends none (each costs the replica CPU while it denoises).
    """

    batch_id: str
    signature: BatchSignature
    requests: tuple[SamplingParams, ...]
    preferred_replica: str | None = None
    report_steps: bool = False

    @property
    def size(self) -> int:
        """Images in the batch (a request with ``n`` counts ``n``)."""
        return sum(p.n for p in self.requests)


@dataclass(frozen=True)
class ModelFacts:
    """What the Ingress needs to validate requests without loading the model.

    ``spatial_factor``: pixels per latent token side. ``num_blocks``: transformer blocks
    cache-dit sees (bounds Fn + Bn). ``longest_block_list``: blocks of the longest list it
    caches (FLUX.2's single-stream list; 0: ``num_blocks``): Fn + Bn reaching it leaves none
    to cache. ``attention_rejections``: kernel name -> reasons it
    cannot run here. ``text_tokens``: the text encoder's padded length. ``temporal_factor``:
    0 for an image model. ``special_tokens``: the tokenizers' special strings.
    ``scm_preset_steps``: preset -> step counts cache-dit's mask builder accepts.
    ``input_modes``: the :class:`InputMode` values beyond text the checkpoint serves;
    ``max_input_images``: images one request may give. ``cfg_threshold``: a CFG-style model
    runs its guiding forward when ``guidance_scale`` exceeds it (Wan: 1, Z-Image: 0).
    ``min_steps``: the fewest ``num_inference_steps`` the model's scheduler runs correctly.
    ``true_cfg_default``: a TRUE_CFG model's ``true_cfg_scale`` when a request gives a negative
    prompt but no scale (the pipeline's default: FLUX 1.0, Qwen-Image 4.0). ``world_size``: the
    ranks one sample's sequence is split across (a CFG group's); ``cfg_degree``: CFG groups.
    ``sequence_multiple``: the model pads a sample's split sequence to a multiple of it (Z-Image:
    32), so a ``world_size`` dividing it splits any size. ``requires_image``: the model only
    edits (every request gives an image: ``POST /v1/images/edits``). ``max_side`` (pixels),
    ``max_latent_frames``, ``max_aspect_ratio``: what the model's position tables and encoders
    take (0: any; ``ModelFamily``).
    """

    family: str
    spatial_factor: int
    guidance_embeds: bool
    num_blocks: int = 0
    longest_block_list: int = 0
    attention_rejections: dict = field(default_factory=dict)
    world_size: int = 1
    text_tokens: int = 0
    guidance_style: GuidanceMode = GuidanceMode.TRUE_CFG
    dual_mode: DualMode = DualMode.SINGLE
    temporal_factor: int = 0
    boundary_ratio: float | None = None
    special_tokens: tuple[str, ...] = ()
    scm_preset_steps: dict = field(default_factory=dict)
    input_modes: tuple[InputMode, ...] = ()
    max_input_images: int = 1
    cfg_threshold: float = 1.0
    min_steps: int = 1
    true_cfg_default: float = 1.0
    cfg_degree: int = 1
    sequence_multiple: int = 1
    requires_image: bool = False
    max_side: int = 0
    max_latent_frames: int = 0
    max_aspect_ratio: float = 0.0

    @property
    def edits_by_reference_only(self) -> bool:
        """The model only edits, by reference: its smallest request gives one image, whose tokens
        join the sequence (``deployments.config.default_request_cost`` counts it)."""
        return self.requires_image and InputMode.REFERENCE in self.input_modes

    def limits(self, model_name: str, limits: dict, loras: dict | None = None) -> ServingLimits:
        """The validation context: these facts plus the config's ``limits`` section
        (``deployments.config.LimitsConfig`` as a dict) and the registered LoRA adapters
        (name -> ``pipeline.contract.lora.LoraEntry``)."""
        width, height = parse_size(limits["default_size"])
        return ServingLimits(
            model_name=model_name, spatial_factor=self.spatial_factor, default_width=width, default_height=height,
            default_steps=limits["default_steps"], default_guidance_scale=limits["default_guidance_scale"],
            max_n=limits["max_n"], max_pixels=limits["max_pixels"], max_steps=limits["max_steps"],
            max_prompt_chars=limits["max_prompt_chars"], guidance_embeds=self.guidance_embeds,
            num_blocks=self.num_blocks, longest_block_list=self.longest_block_list,
            attention_rejections=self.attention_rejections, world_size=self.world_size,
            guidance_style=self.guidance_style, dual_mode=self.dual_mode, temporal_factor=self.temporal_factor,
            default_num_frames=limits["default_num_frames"], default_fps=limits["default_fps"],
            max_frames=limits["max_frames"], default_boundary_ratio=self.boundary_ratio,
            special_tokens=self.special_tokens, scm_preset_steps=self.scm_preset_steps,
            max_timeout_s=limits.get("max_timeout_s", 3600.0),
            default_image_priority=limits.get("default_image_priority", "interactive"),
            default_video_priority=limits.get("default_video_priority", "interactive"),
            loras=dict(loras or {}), max_loras=limits.get("max_loras", 4), input_modes=self.input_modes,
            max_input_images=self.max_input_images, default_strength=limits.get("default_strength", 0.6),
            max_input_pixels=limits.get("max_input_pixels") or default_max_input_pixels(limits["max_pixels"]),
            cfg_threshold=self.cfg_threshold,
            min_steps=self.min_steps, true_cfg_default=self.true_cfg_default, cfg_degree=self.cfg_degree,
            sequence_multiple=self.sequence_multiple, requires_image=self.requires_image, max_side=self.max_side,
            max_latent_frames=self.max_latent_frames, max_aspect_ratio=self.max_aspect_ratio)


class Report(BaseModel):
    """A metadata model that also reads like the dict it replaced (``meta["seed"]``, ``**meta``),
    so handle callers written against the untyped block keep working."""

    def __getitem__(self, key: str):
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> list[str]:
        return list(self.model_dump(exclude_none=True))

    def get(self, key: str, default=None):
        return self[key] if key in self.keys() else default


class TransformerCacheReport(Report):
    """Cache-DiT on one transformer of a dual-transformer model in this batch: ``steps`` it
    ran, of which ``cached_steps`` were served from cache."""

    active: bool
    transition: str
    steps: int
    cached_steps: int


class CacheDiTReport(Report):
    """Cache-DiT in this batch: mounted or not, the transition made at the batch boundary
    (``none | refresh | mount | unmount | remount``), steps cached and computed by the
    primary transformer; ``transformers`` per transformer for dual-transformer models."""

    active: bool = False
    transition: str = "none"
    cached_steps: int = 0
    computed_steps: int = 0
    transformers: dict[str, TransformerCacheReport] | None = None

    @model_serializer(mode="wrap")
    def _omit_single(self, handler):
        data = handler(self)
        if data.get("transformers") is None:
            data.pop("transformers", None)
        return data


class CfgGateReport(Report):
    """CFG gating: the request's ``cfg_gate_step`` fraction and the steps that reused the
    last guiding delta instead of computing the guiding forward."""

    gate_step: float = 1.0
    reused_steps: int = 0


class LoraReport(Report):
    """The LoRA adapters of a batch: ``active`` as ``name:scale``, and how many of them the
    replica had to load from disk for it (``loads``; 0: all came from its LRU)."""

    active: list[str] = []
    loads: int = 0


class AccelerationReport(Report):
    """Which accelerations ran for a batch. ``attention_backend``: the kernel name or
    ``"default"``. ``transformer_calls``: transformer name -> forwards run. ``lora``: the
    adapters applied (:class:`LoraReport`)."""

    cache_dit: CacheDiTReport = CacheDiTReport()
    attention_backend: str = "default"
    cfg_gate: CfgGateReport = CfgGateReport()
    transformer_calls: dict[str, int] = {}
    lora: LoraReport = LoraReport()


class BatchReport(Report):
    """The batch a request ran in, as the replica saw it: its id, images, signature (as
    text), the replica and its ranks, and whether the replica changed state for it.
    ``batch_size``: images in the batch as it was dispatched; rows of gone requests dropped at a
    step boundary later still count (the batch ran them up to there)."""

    batch_id: str
    batch_size: int
    signature: str
    replica: str
    world_size: int
    state_change: bool


@dataclass
class RequestOutput:
    """One request's answer from a replica.

    ``images``: encoded images (PNG), ``n`` of them; for a video request, its thumbnail (the
    first frame, WebP); ``videos``: encoded videos (MP4).
    ``timings_ms``: ``denoise`` and ``decode`` (the replica's, ms); the Router adds ``queue``.
    ``batch``: filled in by the replica. ``error``: set (and no media) when this request alone
    failed inside its batch, e.g. text its tokenizer could not take; the others ran.
    """

    request_id: str
    seed: int
    images: list[bytes]
    timings_ms: dict[str, float]
    acceleration: AccelerationReport
    videos: list[bytes] = field(default_factory=list)
    batch: BatchReport | None = None
    error: "DitServeError | None" = None
    dropped_at_step: int | None = None  # its rows left the batch after this many steps: nobody waited


class GenerationMetadata(BatchReport):
    """The ``ditserve`` block of a response (images) or of a completed video job: the request,
    its batch (:class:`BatchReport`), seed, timings and accelerations.

    ``timings_ms``: ``queue`` (waiting in the Router), ``denoise``, ``decode`` (decode and
    encoding) and ``total`` (as the Ingress measured it), milliseconds.
    """

    request_id: str
    seed: int
    timings_ms: dict[str, float]
    acceleration: AccelerationReport

    @classmethod
    def of(cls, out: RequestOutput, total_ms: float | None = None) -> "GenerationMetadata":
        timings = {k: round(v, 3) for k, v in out.timings_ms.items()}
        if total_ms is not None:
            timings["total"] = round(total_ms, 3)
        return cls(**dict(out.batch), request_id=out.request_id, seed=out.seed, timings_ms=timings,
                   acceleration=out.acceleration)
