"""SamplingParams: the validated, fully resolved settings of one request."""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass

from pipeline.accel import freeze_cache_dit_params
from pipeline.contract import ImageGenerationRequest, ServingLimits, parse_size


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

    ``width``/``height`` in pixels; ``num_frames`` is 1 for images. ``do_true_cfg`` is
    diffusers' rule: ``true_cfg_scale > 1`` and a negative prompt given.
    ``cache_dit_params`` is the frozen override key (hashable).
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


def resolve(request: ImageGenerationRequest, limits: ServingLimits,
            defaults: AccelerationDefaults = AccelerationDefaults(),
            request_id: str | None = None) -> SamplingParams:
    """Apply server defaults to a validated request. A missing ``seed`` is drawn here so
    the answer can report it and the request can be replayed exactly."""
    if request.size is not None:
        width, height = parse_size(request.size)
    else:
        width, height = limits.default_width, limits.default_height
    true_cfg_scale = 1.0 if request.true_cfg_scale is None else request.true_cfg_scale
    do_true_cfg = true_cfg_scale > 1.0 and request.negative_prompt is not None
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
    return SamplingParams(
        request_id=request_id or f"img-{uuid.uuid4().hex[:16]}",
        model=limits.model_name,
        prompt=request.prompt,
        negative_prompt=request.negative_prompt if do_true_cfg else None,
        n=request.n,
        width=width,
        height=height,
        num_frames=1,
        num_inference_steps=request.num_inference_steps or limits.default_steps,
        guidance_scale=(limits.default_guidance_scale if request.guidance_scale is None
                        else request.guidance_scale) if limits.guidance_embeds else 0.0,
        true_cfg_scale=true_cfg_scale if do_true_cfg else 1.0,
        do_true_cfg=do_true_cfg,
        seed=request.seed if request.seed is not None else secrets.randbelow(2**31),
        enable_cache_dit=enable_cache_dit,
        cache_dit_params=cache_key,
        cfg_gate_step=request.cfg_gate_step if request.cfg_gate_step is not None else defaults.cfg_gate_step,
        attention_backend=request.attention_backend_override or defaults.attention_backend,
        response_format=request.response_format,
        timeout_s=request.timeout_s,
    )
