"""SamplingParams: the validated, fully resolved settings of one request."""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass

from pipeline.accel import freeze_cache_dit_params
from pipeline.contract import ImageGenerationRequest, ServingLimits, VideoGenerationRequest, parse_size


@dataclass(frozen=True)
class AccelerationDefaults:
    """Server defaults of the per-request acceleration fields (a request's ``None``)."""

    enable_cache_dit: bool = False
    cache_dit_params: tuple | None = None  # frozen key, see pipeline.accel.freeze_cache_dit_params
    cfg_gate_step: float = 1.0
    attention_backend: str | None = None  # None: the model's own attention processor


@dataclass(frozen=True)
class SamplingParams:
    """One request, resolved: server defaults applied, seed drawn, CFG mode decided.

    ``width``/``height`` in pixels; ``num_frames`` is 1 for images. ``do_true_cfg``: a
    guiding forward runs, with scale ``true_cfg_scale`` — diffusers' rules per model style:
    FLUX ``true_cfg_scale > 1`` and a negative prompt given; Wan ``guidance_scale > 1``
    (negative prompt default ""); paired-transformer models always. ``guidance_scale`` is
    FLUX's embedded guidance (0.0 for models without it). ``cache_dit_params`` is the
    frozen override key (hashable). ``fps`` only matters to the MP4 container.
    """

    request_id: str
    model: str
    prompt: str
    negative_prompt: str | None
    n: int
    width: int
    height: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float
    do_true_cfg: bool
    seed: int
    enable_cache_dit: bool
    cache_dit_params: tuple | None
    cfg_gate_step: float
    attention_backend: str | None
    response_format: str
    timeout_s: float | None = None  # deadline in seconds from submission; None: none
    guidance_scale_2: float | None = None  # low-noise expert's guidance (boundary models)
    boundary_ratio: float | None = None  # None: the model's own
    fps: int = 0  # videos: frames per second of the MP4; 0 for images


def _size(request, limits: ServingLimits) -> tuple[int, int]:
    """(width, height) in pixels: the request's ``size`` or the server default."""
    if request.size is not None:
        return parse_size(request.size)
    return limits.default_width, limits.default_height


def _acceleration(request, defaults: AccelerationDefaults) -> dict:
    if request.enable_cache_dit is False:
        enable_cache_dit = False
    elif request.enable_cache_dit is None:
        enable_cache_dit = defaults.enable_cache_dit
    else:
        enable_cache_dit = True
    cache_key = None
    if enable_cache_dit:
        cache_key = (freeze_cache_dit_params(request.cache_dit_params)
                     if request.cache_dit_params is not None else defaults.cache_dit_params) or ()
    return {"enable_cache_dit": enable_cache_dit, "cache_dit_params": cache_key,
            "cfg_gate_step": request.cfg_gate_step if request.cfg_gate_step is not None else defaults.cfg_gate_step,
            "attention_backend": request.attention_backend_override or defaults.attention_backend}


def _guidance(request, limits: ServingLimits) -> dict:
    """The CFG fields under the model's style (see ``SamplingParams``)."""
    guidance_scale = limits.default_guidance_scale if request.guidance_scale is None else request.guidance_scale
    if limits.cfg_style == "true_cfg":
        true_cfg_scale = getattr(request, "true_cfg_scale", None)
        true_cfg_scale = 1.0 if true_cfg_scale is None else true_cfg_scale
        do_true_cfg = true_cfg_scale > 1.0 and request.negative_prompt is not None
        return {"guidance_scale": guidance_scale if limits.guidance_embeds else 0.0,
                "true_cfg_scale": true_cfg_scale if do_true_cfg else 1.0, "do_true_cfg": do_true_cfg,
                "negative_prompt": request.negative_prompt if do_true_cfg else None}
    if limits.cfg_style == "paired":
        return {"guidance_scale": 0.0, "true_cfg_scale": guidance_scale, "do_true_cfg": True,
                "negative_prompt": None}
    do_cfg = guidance_scale > 1.0  # WanPipeline.do_classifier_free_guidance
    return {"guidance_scale": 0.0, "true_cfg_scale": guidance_scale if do_cfg else 1.0, "do_true_cfg": do_cfg,
            "negative_prompt": (request.negative_prompt or "") if do_cfg else None}


def resolve(request: ImageGenerationRequest, limits: ServingLimits,
            defaults: AccelerationDefaults = AccelerationDefaults(),
            request_id: str | None = None) -> SamplingParams:
    """Apply server defaults to a validated image request. A missing ``seed`` is drawn here
    so the answer can report it and the request can be replayed exactly."""
    width, height = _size(request, limits)
    return SamplingParams(
        request_id=request_id or f"img-{uuid.uuid4().hex[:16]}",
        model=limits.model_name,
        prompt=request.prompt,
        n=request.n,
        width=width,
        height=height,
        num_frames=1,
        num_inference_steps=request.num_inference_steps or limits.default_steps,
        seed=request.seed if request.seed is not None else secrets.randbelow(2**31),
        response_format=request.response_format,
        timeout_s=request.timeout_s,
        **_guidance(request, limits),
        **_acceleration(request, defaults),
    )


def resolve_video(request: VideoGenerationRequest, limits: ServingLimits,
                  defaults: AccelerationDefaults = AccelerationDefaults(),
                  request_id: str | None = None) -> SamplingParams:
    """Apply server defaults to a validated video request (one video per request)."""
    width, height = _size(request, limits)
    return SamplingParams(
        request_id=request_id or f"video_{uuid.uuid4().hex[:24]}",
        model=limits.model_name,
        prompt=request.prompt,
        n=1,
        width=width,
        height=height,
        num_frames=request.frames(limits),
        num_inference_steps=request.num_inference_steps or limits.default_steps,
        seed=request.seed if request.seed is not None else secrets.randbelow(2**31),
        response_format="mp4",
        timeout_s=request.timeout_s,
        guidance_scale_2=request.guidance_scale_2,
        boundary_ratio=request.boundary_ratio,
        fps=request.fps or limits.default_fps,
        **_guidance(request, limits),
        **_acceleration(request, defaults),
    )
