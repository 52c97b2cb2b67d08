"""SamplingParams: the validated, fully resolved settings of one request (torch-free)."""

from __future__ import annotations

import dataclasses
import math
import secrets
import uuid
from dataclasses import dataclass

from pipeline.cache_dit_params import CacheDiTParams
from pipeline.contract.base import cache_dit_problems, nothing_cached_problems, step_problems
from pipeline.contract.edits import ImageEditRequest, decode_edit_inputs, decode_reference, default_strength, \
    edit_mode, effective_steps, strength_runs
from pipeline.contract.images import ImageGenerationRequest
from pipeline.contract.limits import ServingLimits, encoding_problem, parse_size, size_problem, split_problem
from pipeline.contract.lora import LoraSpec, resolve_loras, split_model
from pipeline.contract.videos import VideoGenerationRequest
from pipeline.errors import InvalidRequestError
from pipeline.modes import GuidanceMode, InputMode, Priority
from pipeline.wire import ImageArray


@dataclass(frozen=True)
class AccelerationDefaults:
    """Server defaults of the per-request acceleration fields (what a request's ``None`` means).

    ``cfg_gate_fraction``: the default of the request field ``cfg_gate_step``, a fraction of
    the steps in (0, 1].
    """

    enable_cache_dit: bool = False
    cache_dit_params: CacheDiTParams | None = None
    cfg_gate_fraction: float = 1.0
    attention_backend: str | None = None  # None: the model's own attention processor

    @classmethod
    def from_config(cls, acceleration: dict) -> "AccelerationDefaults":
        """From the ``acceleration`` config section (``deployments.config.AccelerationConfig`` as a dict)."""
        params = acceleration.get("cache_dit_params")
        return cls(enable_cache_dit=bool(acceleration.get("enable_cache_dit", False)),
                   cache_dit_params=None if params is None else CacheDiTParams.model_validate(params),
                   cfg_gate_fraction=float(acceleration.get("cfg_gate_step", 1.0)),
                   attention_backend=acceleration.get("attention_backend"))

    def cache_dit_problem(self, limits: ServingLimits, model_known: bool = True) -> str | None:
        """Why the default Cache-DiT knobs do not fit the model (None: they do). They run
        wherever a request turns Cache-DiT on (none may cache nothing); on by default, they run
        every request that leaves out ``num_inference_steps``, so they must fit
        ``limits.default_steps`` too. ``model_known`` False: a config read without the model
        (its blocks and experts unknown), checked against ``limits.default_steps`` alone
        (helper-60: a warmup of 50 over 16 default steps deployed, then refused every request
        running the defaults)."""
        if self.cache_dit_params is None and not self.enable_cache_dit:
            return None
        params = self.cache_dit_params or CacheDiTParams()
        steps = limits.default_steps if self.enable_cache_dit else None
        if model_known:
            problems = [*cache_dit_problems(params, limits, steps), *nothing_cached_problems(params, limits, steps)]
        else:  # no blocks known (num_blocks 0 skips their checks), nor presets' step counts
            unknown = dataclasses.replace(limits, num_blocks=0, longest_block_list=0, scm_preset_steps={})
            problems = [*(step_problems(params, unknown, steps) if steps else []),
                        *nothing_cached_problems(params, unknown, steps)]
        if not problems:
            return None
        if model_known:
            fits = " does not fit the model and its limits.default_steps" if steps else " does not fit the model"
        else:
            fits = " does not fit limits.default_steps" if steps else ""
        return f"acceleration.cache_dit_params{fits}: " + "; ".join(problems)


@dataclass(frozen=True)
class SamplingParams:
    """One request, resolved: server defaults applied, seed drawn, guidance decided.

    ``width``/``height`` in pixels; ``num_frames`` is 1 for images. Guidance, as the loop
    runs it: ``guidance_mode`` (:class:`GuidanceMode`; ``NONE``: no guiding forward) and
    ``cfg_scale``, the scale of ``guide + cfg_scale · (cond − guide)`` (1.0 when unguided) —
    FLUX's ``true_cfg_scale``, Wan's ``guidance_scale`` or the paired guide's scale;
    ``cfg_scale_2``: the request's ``guidance_scale_2`` (the low-noise expert's scale of
    boundary models). ``embedded_guidance_scale``: FLUX.1-dev's distilled guidance input (the
    request's ``guidance_scale``; None for models without a guidance embedding).
    ``cache_dit_params``: the override when Cache-DiT is on (an empty one: cache-dit's
    defaults; made canonical by :func:`check_cache_dit`), None when off. ``cfg_gate_fraction``:
    the request's ``cfg_gate_step``.
    ``fps`` only matters to the MP4 container. ``lora``: the LoRA adapters to apply, sorted by
    name (empty: the base model); ``model_adapter``: the one of them the request's ``model``
    selected (``"<base>:<adapter>"``), so an error about it names ``model``. Image inputs:
    ``input_mode`` (:class:`InputMode`),
    ``strength`` (image-to-image and inpainting; :attr:`effective_steps` of the
    ``num_inference_steps`` run), ``num_input_images``; ``images`` (RGB at ``width`` ×
    ``height``) and ``mask`` (its alpha) are per request, like the prompt.
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
    guidance_mode: GuidanceMode
    cfg_scale: float
    embedded_guidance_scale: float | None
    seed: int
    enable_cache_dit: bool
    cache_dit_params: CacheDiTParams | None
    cfg_gate_fraction: float
    attention_backend: str | None
    response_format: str
    output_format: str = "png"  # images: png | jpeg | webp (pipeline.media.encode_image)
    output_compression: int | None = None  # jpeg/webp quality 0..100; None: 100
    timeout_s: float | None = None  # deadline in seconds from submission; None: none
    priority: Priority = Priority.INTERACTIVE  # the order queues are served in (deployments.scheduling)
    cfg_scale_2: float | None = None
    boundary_ratio: float | None = None  # None: the model's own
    fps: int = 0
    lora: tuple[LoraSpec, ...] = ()
    model_adapter: str | None = None
    partial_images: int = 0  # streamed previews (decoded for this request's rows only)
    input_mode: InputMode = InputMode.TEXT
    strength: float | None = None
    num_input_images: int = 0
    images: tuple[ImageArray, ...] = ()
    mask: ImageArray | None = None

    def adapter_field(self, name: str) -> str:
        """The request field that named adapter ``name``: ``model`` or ``lora``."""
        return "model" if name == self.model_adapter else "lora"

    @property
    def effective_steps(self) -> int:
        """Denoising steps that run: ``num_inference_steps``, fewer with ``strength`` < 1."""
        return effective_steps(self.num_inference_steps, self.strength)

    @property
    def guided(self) -> bool:
        """Whether a guiding forward runs (before any CFG gate)."""
        return self.guidance_mode != GuidanceMode.NONE

    @property
    def cfg_gate(self) -> int | None:
        """The step (0-based, of the :attr:`effective_steps` that run) from which CFG gating reuses
        the guiding delta; None when it reuses none: ``cfg_gate_fraction`` 1, an unguided request,
        or a 1-step run. What the batch runs, so fractions with one gate (0.1 and 0.2 of 6 steps:
        step 1) share a batch."""
        steps = self.effective_steps
        at = cfg_gate_at(self.cfg_gate_fraction, steps)
        return at if self.guided and at < steps else None


def cfg_gate_at(fraction: float, steps: int) -> int:
    """Index of the first of ``steps`` whose guiding forward CFG gating skips:
    ``max(1, floor(fraction · steps))`` for ``fraction`` < 1, ``steps`` (none) for 1."""
    return steps if fraction >= 1.0 else max(1, math.floor(fraction * steps))


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
    params = None
    if enable_cache_dit:
        params = request.cache_dit_params or defaults.cache_dit_params or CacheDiTParams()
    return {"enable_cache_dit": enable_cache_dit, "cache_dit_params": params,
            "cfg_gate_fraction": (request.cfg_gate_step if request.cfg_gate_step is not None
                                  else defaults.cfg_gate_fraction),
            "attention_backend": request.attention_backend_override or defaults.attention_backend}


def _guidance(request, limits: ServingLimits) -> dict:
    """The guidance fields under the model's guidance style (diffusers' rules, see ``SamplingParams``)."""
    guidance_scale = limits.default_guidance_scale if request.guidance_scale is None else request.guidance_scale
    style = limits.guidance_style
    if style == GuidanceMode.TRUE_CFG:
        true_cfg_scale = getattr(request, "true_cfg_scale", None)
        true_cfg_scale = limits.true_cfg_default if true_cfg_scale is None else true_cfg_scale
        guided = true_cfg_scale > 1.0 and request.negative_prompt is not None
        return {"guidance_mode": style if guided else GuidanceMode.NONE,
                "cfg_scale": true_cfg_scale if guided else 1.0,
                "embedded_guidance_scale": guidance_scale if limits.guidance_embeds else None,
                "negative_prompt": request.negative_prompt if guided else None}
    if style == GuidanceMode.AUTOGUIDANCE:
        return {"guidance_mode": style, "cfg_scale": guidance_scale, "embedded_guidance_scale": None,
                "negative_prompt": None}
    guided = guidance_scale > limits.cfg_threshold  # the pipeline's do_classifier_free_guidance
    return {"guidance_mode": style if guided else GuidanceMode.NONE, "cfg_scale": guidance_scale if guided else 1.0,
            "embedded_guidance_scale": None, "negative_prompt": (request.negative_prompt or "") if guided else None}


def _loras(request, limits: ServingLimits) -> dict:
    """The request's adapter set (``lora``): the ``model`` adapter (``"<base>:<adapter>"``;
    ``model_adapter``) and ``lora``."""
    adapter = None if request.model is None else split_model(request.model, limits.model_name)
    return {"lora": resolve_loras(request.lora, adapter, limits.loras), "model_adapter": adapter}


def _seed(request) -> int:
    """The request's seed, or one drawn here so the answer can report it and be replayed."""
    return request.seed if request.seed is not None else secrets.randbelow(2**31)


def check_cache_dit(params: SamplingParams, request, limits: ServingLimits) -> SamplingParams:
    """``params`` when the Cache-DiT it runs (``enable_cache_dit`` resolved) fits the model and
    its steps (``effective_steps``) and can cache some of them: the knobs the request did not
    give (the server's default ``acceleration.cache_dit_params``, or cache-dit's own defaults for
    ``enable_cache_dit`` alone; a request's own were checked with its fields) against the model
    and the steps, and every knob against :func:`nothing_cached_problems` (only here, once it is
    known that Cache-DiT runs: a request that turns it off may keep its knobs). The knobs are
    checked as given, then made canonical (``CacheDiTParams.canonical``: overrides that run the
    same share a batch signature). Raises ``InvalidRequestError`` naming ``cache_dit_params`` (a
    400: cache-dit asserted in the batch, a 500; a Cache-DiT that cached nothing said it was active)."""
    if not params.enable_cache_dit or params.cache_dit_params is None:
        return params
    steps, own = params.effective_steps, request.cache_dit_params is not None
    problems = [*([] if own else cache_dit_problems(params.cache_dit_params, limits, steps)),
                *nothing_cached_problems(params.cache_dit_params, limits, steps)]
    if not problems:
        return dataclasses.replace(params, cache_dit_params=params.cache_dit_params.canonical())
    problems = [p + strength_runs(params.strength, steps, params.num_inference_steps) for p in problems]
    if own:
        raise InvalidRequestError("; ".join(problems), param="cache_dit_params", code="invalid_value")
    source = ("cache-dit's own defaults (no cache_dit_params given)" if params.cache_dit_params == CacheDiTParams()
              else "the server's default acceleration.cache_dit_params")
    raise InvalidRequestError(f"cache_dit_params: Cache-DiT would run with {source}, which do not fit this "
                              f"request: {'; '.join(problems)}; give cache_dit_params that fit, or "
                              "enable_cache_dit: false", param="cache_dit_params", code="invalid_value")


def resolve(request: ImageGenerationRequest, limits: ServingLimits,
            defaults: AccelerationDefaults = AccelerationDefaults(),
            request_id: str | None = None) -> SamplingParams:
    """Apply server defaults to a validated image request. Raises ``InvalidRequestError``
    (:func:`check_cache_dit`)."""
    return check_cache_dit(_resolve_image(request, limits, defaults, request_id), request, limits)


def _resolve_image(request: ImageGenerationRequest, limits: ServingLimits, defaults: AccelerationDefaults,
                   request_id: str | None) -> SamplingParams:
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
        seed=_seed(request),
        response_format=request.response_format,
        output_format=request.output_format,
        output_compression=request.output_compression,
        timeout_s=request.timeout_s,
        priority=Priority(request.priority or limits.default_image_priority),
        **_loras(request, limits),
        partial_images=request.partial_images or 0,
        **_guidance(request, limits),
        **_acceleration(request, defaults),
    )


def check_edit_size(width: int, height: int, limits: ServingLimits, field: str, output_format: str = "png") -> None:
    """An edit's output size (its ``size``, or the image's own scaled down): raises
    ``InvalidRequestError`` naming ``field`` for one the model cannot take (:func:`size_problem`:
    a side past its position table, too elongated), sequence parallelism cannot split evenly
    across the ranks (:func:`split_problem`) or ``output_format``'s encoder cannot write
    (:func:`encoding_problem`)."""
    problem = (size_problem(width, height, limits) or split_problem(width, height, limits)
               or encoding_problem(width, height, output_format))
    if problem:
        raise InvalidRequestError(f"{field}: the output {problem}", param=field, code="invalid_value")


def resolve_edit(request: ImageEditRequest, limits: ServingLimits,
                 defaults: AccelerationDefaults = AccelerationDefaults(),
                 request_id: str | None = None) -> SamplingParams:
    """Apply server defaults to a validated edit and decode its uploads (Pillow, in the Ingress).
    Raises ``InvalidRequestError`` naming ``image`` or ``mask`` for an upload that fails, or
    ``cache_dit_params`` (:func:`check_cache_dit`, for the steps ``strength`` runs)."""
    mode = edit_mode(request, limits)
    width, height, images, mask = decode_edit_inputs(request, limits)
    check_edit_size(width, height, limits, "size" if request.size else "image", request.output_format)
    base = _resolve_image(request.model_copy(update={"size": f"{width}x{height}"}), limits, defaults, request_id)
    strength = request.strength if request.strength is not None else default_strength(mode, limits)
    return check_cache_dit(dataclasses.replace(base, input_mode=mode, strength=strength,
                                                           num_input_images=len(images), images=images, mask=mask),
                                       request, limits)


def resolve_video(request: VideoGenerationRequest, limits: ServingLimits,
                  defaults: AccelerationDefaults = AccelerationDefaults(),
                  request_id: str | None = None) -> SamplingParams:
    """Apply server defaults to a validated video request (one video per request); an
    ``input_reference`` is decoded here (image-to-video). Raises ``InvalidRequestError``
    naming ``input_reference`` for an upload that fails, or ``cache_dit_params``
    (:func:`check_cache_dit`)."""
    width, height = _size(request, limits)
    reference = ()
    if request.input_reference is not None:
        reference = (decode_reference(request.input_reference, width, height, limits, "input_reference"),)
    return check_cache_dit(SamplingParams(
        input_mode=InputMode.IMAGE_TO_VIDEO if reference else InputMode.TEXT,
        num_input_images=len(reference),
        images=reference,
        request_id=request_id or f"video_{uuid.uuid4().hex[:24]}",
        model=limits.model_name,
        prompt=request.prompt,
        n=1,
        width=width,
        height=height,
        num_frames=request.frames(limits),
        num_inference_steps=request.num_inference_steps or limits.default_steps,
        seed=_seed(request),
        response_format="mp4",
        timeout_s=request.timeout_s,
        priority=Priority(request.priority or limits.default_video_priority),
        **_loras(request, limits),
        cfg_scale_2=request.guidance_scale_2,
        boundary_ratio=request.boundary_ratio,
        fps=request.fps or limits.default_fps,
        **_guidance(request, limits),
        **_acceleration(request, defaults),
    ), request, limits)
