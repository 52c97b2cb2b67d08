"""Contracts at the edges: the image and video request and response models (HTTP body and handle).

The image request follows OpenAI's ``POST /v1/images/generations`` (``prompt``, ``model``,
``n``, ``size``, ``response_format``), the video request OpenAI's ``POST /v1/videos``
(``prompt``, ``model``, ``size``, ``seconds``), both plus ditserve's extensions. The OpenAI
SDK merges ``extra_body`` into the top level; a literal nested ``extra_body`` object is
merged too. Unknown top-level fields are rejected so a typo never passes silently.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from pipeline.accel import ATTENTION_BACKENDS, validate_cache_dit_params
from pipeline.errors import InvalidRequestError, ModelNotFoundError

MAX_SECONDS = 3600  # a bound before frames are computed; limits.max_frames is the real cap
SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*x\s*(\d{1,6})\s*$")


@dataclass(frozen=True)
class ServingLimits:
    """What the served model and the server configuration allow; the validation context.

    ``spatial_factor``: width and height must be multiples of it (pixels; FLUX: VAE factor
    8 × patch 2 = 16). ``max_pixels``: width × height. Defaults fill fields a request omits.
    """

    model_name: str
    spatial_factor: int
    default_width: int
    default_height: int
    default_steps: int
    default_guidance_scale: float
    max_n: int = 4
    max_pixels: int = 1024 * 1024
    max_steps: int = 100
    max_prompt_chars: int = 2000
    guidance_embeds: bool = True
    num_blocks: int = 0  # transformer blocks cache-dit sees; 0: unknown (not checked)
    attention_rejections: dict = field(default_factory=dict)  # kernel -> reasons it cannot run here
    world_size: int = 1  # sequence-parallel ranks: token counts must split evenly
    cfg_style: str = "true_cfg"  # "true_cfg" (FLUX), "cfg" (Wan: guidance_scale > 1), "paired"
    dual_mode: str | None = None  # None, "boundary" (Wan 2.2 experts) or "paired"
    temporal_factor: int = 0  # video models: num_frames = k · temporal_factor + 1; 0: images only
    default_num_frames: int = 1
    default_fps: int = 16
    max_frames: int = 1
    default_boundary_ratio: float | None = None


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` → ``(width, height)`` in pixels; raises ``ValueError`` if malformed."""
    match = SIZE_RE.match(size)
    if not match:
        raise ValueError(f"size must look like '1024x1024' (WIDTHxHEIGHT in pixels), got {size!r}")
    return int(match.group(1)), int(match.group(2))


def _limits(info: ValidationInfo) -> ServingLimits | None:
    return (info.context or {}).get("limits")


class _GenerationRequest(BaseModel):
    """Fields and checks shared by image and video requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: str
    model: str | None = None
    size: str | None = None
    user: str | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = Field(default=None, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    enable_cache_dit: bool | None = None
    cache_dit_params: dict[str, Any] | None = None
    cfg_gate_step: float | None = Field(default=None, allow_inf_nan=False)
    attention_backend_override: str | None = None
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
            data = dict(data)
            nested = data.pop("extra_body")
            clash = sorted(set(nested) & set(data))
            if clash:
                raise ValueError(f"extra_body repeats top-level field(s) {', '.join(clash)}")
            data.update(nested)
        return data

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str, info: ValidationInfo) -> str:
        if not v.strip():
            raise ValueError("prompt must not be empty")
        limits = _limits(info)
        if limits and len(v) > limits.max_prompt_chars:
            raise ValueError(f"prompt has {len(v)} characters; at most {limits.max_prompt_chars} are allowed")
        return v

    @field_validator("negative_prompt")
    @classmethod
    def _negative_prompt(cls, v: str | None, info: ValidationInfo) -> str | None:
        limits = _limits(info)
        if v is not None and limits and len(v) > limits.max_prompt_chars:
            raise ValueError(f"negative_prompt has {len(v)} characters; at most {limits.max_prompt_chars} are allowed")
        if v is not None and limits and limits.cfg_style == "paired":
            raise ValueError("negative_prompt is not used by this paired-transformer model (its second "
                             "transformer guides from the prompt itself); leave it out")
        return v

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        width, height = parse_size(v)
        limits = _limits(info)
        if limits:
            f = limits.spatial_factor
            if width < f or height < f or width % f or height % f:
                raise ValueError(f"size {width}x{height}: width and height must be positive multiples of {f} pixels")
            if width * height > limits.max_pixels:
                raise ValueError(
                    f"size {width}x{height} has {width * height} pixels; at most {limits.max_pixels} are allowed")
        return v

    @field_validator("num_inference_steps")
    @classmethod
    def _steps(cls, v: int | None, info: ValidationInfo) -> int | None:
        limits = _limits(info)
        top = limits.max_steps if limits else None
        if v is not None and (v < 1 or (top is not None and v > top)):
            raise ValueError(f"num_inference_steps must be between 1 and {top}, got {v}")
        return v

    @field_validator("guidance_scale")
    @classmethod
    def _scale(cls, v: float | None, info: ValidationInfo) -> float | None:
        return _non_negative(v, info)

    @field_validator("cache_dit_params")
    @classmethod
    def _cache_dit_params(cls, v: dict | None, info: ValidationInfo) -> dict | None:
        if v is not None:
            problems = validate_cache_dit_params(v)
            limits = _limits(info)
            if not problems and limits and "secondary" in v and limits.dual_mode is None:
                problems.append("cache_dit_params.secondary is only for models with two transformers; "
                                f"{limits.model_name!r} has one")
            if not problems and limits and limits.num_blocks:
                for where, knobs in (("cache_dit_params", v), ("cache_dit_params.secondary", v.get("secondary") or {})):
                    used = knobs.get("Fn_compute_blocks", 8) + knobs.get("Bn_compute_blocks", 0)
                    if used > limits.num_blocks:
                        problems.append(f"{where}: Fn_compute_blocks + Bn_compute_blocks = {used} exceeds the "
                                        f"model's {limits.num_blocks} transformer blocks")
            if problems:
                raise ValueError("; ".join(problems))
        return v

    @field_validator("cfg_gate_step")
    @classmethod
    def _cfg_gate_step(cls, v: float | None) -> float | None:
        if v is not None and not 0.0 < v <= 1.0:
            raise ValueError(f"cfg_gate_step must be in (0, 1] (1.0 turns gating off), got {v}")
        return v

    @field_validator("attention_backend_override")
    @classmethod
    def _attention_backend(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and v not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend_override must be one of {', '.join(ATTENTION_BACKENDS)}, got {v!r}")
        limits = _limits(info)
        if v is not None and limits and limits.attention_rejections.get(v):
            raise ValueError(f"attention_backend_override {v!r} cannot run on this deployment: "
                             + "; ".join(limits.attention_rejections[v]))
        return v

    @model_validator(mode="after")
    def _scm_bins_cover_steps(self, info: ValidationInfo):
        limits = _limits(info)
        bins = self.cache_dit_params or {}
        if limits and "scm_compute_bins" in bins:
            steps = self.num_inference_steps or limits.default_steps
            covered = sum(bins["scm_compute_bins"]) + sum(bins["scm_cache_bins"])
            if covered < steps:
                raise ValueError(f"cache_dit_params: scm_compute_bins + scm_cache_bins cover {covered} steps, "
                                 f"fewer than num_inference_steps={steps}")
        return self

    def _check_split(self, limits: ServingLimits | None, latent_frames: int) -> None:
        """Sequence parallelism splits the latent tokens of a sample evenly across the ranks."""
        if not limits or limits.world_size <= 1:
            return
        width, height = parse_size(self.size) if self.size else (limits.default_width, limits.default_height)
        f = limits.spatial_factor
        tokens = latent_frames * (width // f) * (height // f)
        if tokens % limits.world_size:
            raise ValueError(f"size: {width}x{height} gives {tokens} latent tokens, which cannot be split "
                             f"evenly across the replica's {limits.world_size} sequence-parallel ranks")


def _non_negative(v: float | None, info: ValidationInfo) -> float | None:
    if v is not None and (not math.isfinite(v) or v < 0):
        raise ValueError(f"{info.field_name} must be a finite number >= 0, got {v}")
    return v


class ImageGenerationRequest(_GenerationRequest):
    """Body of ``POST /v1/images/generations`` and argument of the handle's ``generate``.

    Validate with :func:`validate_image_request`, which applies the served model's limits
    and reports every problem in one :class:`InvalidRequestError`.
    """

    n: int = 1
    response_format: str = "b64_json"
    true_cfg_scale: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("n")
    @classmethod
    def _n(cls, v: int, info: ValidationInfo) -> int:
        limits = _limits(info)
        top = limits.max_n if limits else None
        if v < 1 or (top is not None and v > top):
            raise ValueError(f"n must be between 1 and {top}, got {v}")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: str) -> str:
        if v != "b64_json":
            raise ValueError(f"response_format must be 'b64_json' (the only format served), got {v!r}")
        return v

    @field_validator("true_cfg_scale")
    @classmethod
    def _true_cfg_scale(cls, v: float | None, info: ValidationInfo) -> float | None:
        return _non_negative(v, info)

    @model_validator(mode="after")
    def _tokens_split(self, info: ValidationInfo) -> "ImageGenerationRequest":
        self._check_split(_limits(info), 1)
        return self


class VideoGenerationRequest(_GenerationRequest):
    """Body of ``POST /v1/videos`` and argument of the handle's ``submit_video``.

    ``seconds`` (OpenAI's field; a number or numeric string) or ``num_frames`` set the
    length: ``seconds`` becomes ``temporal_factor · round(seconds · fps / temporal_factor) + 1``
    frames; ``num_frames`` must already be of that form (Wan: 4k + 1). ``fps``: frames per
    second of the MP4. ``guidance_scale_2`` (guidance of the low-noise expert) and
    ``boundary_ratio`` (in [0, 1], the fraction of ``num_train_timesteps`` below which the
    second expert runs) apply to boundary-expert models (Wan 2.2 A14B) only.
    """

    seconds: float | str | None = None
    num_frames: int | None = None
    fps: int | None = None
    guidance_scale_2: float | None = Field(default=None, allow_inf_nan=False)
    boundary_ratio: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("seconds")
    @classmethod
    def _seconds(cls, v: float | str | None) -> float | None:
        if v is None:
            return v
        try:
            seconds = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"seconds must be a number of seconds > 0, got {v!r}") from None
        if not math.isfinite(seconds) or not 0 < seconds <= MAX_SECONDS:
            raise ValueError(f"seconds must be a number of seconds in (0, {MAX_SECONDS}], got {v!r}")
        return seconds

    @field_validator("fps")
    @classmethod
    def _fps(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= 120:
            raise ValueError(f"fps must be between 1 and 120, got {v}")
        return v

    @field_validator("guidance_scale_2", "boundary_ratio")
    @classmethod
    def _boundary_fields(cls, v: float | None, info: ValidationInfo) -> float | None:
        limits = _limits(info)
        if v is not None and limits and limits.dual_mode != "boundary":
            raise ValueError(f"{info.field_name} applies to models with boundary experts (Wan 2.2 A14B); "
                             f"{limits.model_name!r} has none")
        if info.field_name == "boundary_ratio" and v is not None and not 0.0 <= v <= 1.0:
            raise ValueError(f"boundary_ratio must be in [0, 1], got {v}")
        return _non_negative(v, info)

    def frames(self, limits: ServingLimits) -> int:
        """The frame count this request asks for (before the limit checks)."""
        factor = max(limits.temporal_factor, 1)
        fps = self.fps or limits.default_fps
        if self.num_frames is not None:
            return self.num_frames
        if self.seconds is not None:
            return factor * max(1, round(float(self.seconds) * fps / factor)) + 1
        return limits.default_num_frames

    @model_validator(mode="after")
    def _length(self, info: ValidationInfo) -> "VideoGenerationRequest":
        limits = _limits(info)
        if self.seconds is not None and self.num_frames is not None:
            raise ValueError("seconds: give either seconds or num_frames, not both")
        if not limits:
            return self
        frames = self.frames(limits)
        field = "num_frames" if self.num_frames is not None else "seconds"
        factor = limits.temporal_factor
        if frames < 1 or (factor and (frames - 1) % factor):
            raise ValueError(f"{field}: num_frames must be {factor}·k + 1 (the VAE's temporal factor is {factor}), "
                             f"e.g. {factor + 1}, {2 * factor + 1}, {4 * factor + 1}; got {frames}")
        if frames > limits.max_frames:
            raise ValueError(f"{field}: {frames} frames requested; at most {limits.max_frames} are allowed")
        self._check_split(limits, (frames - 1) // max(factor, 1) + 1)
        return self


def _describe(error: dict, model: type[BaseModel]) -> tuple[str, str]:
    message = error.get("msg", "invalid")
    message = message.removeprefix("Value error, ")
    field = ".".join(str(p) for p in error.get("loc", ())) or message.split(":")[0].split(" ")[0]
    if field not in model.model_fields:
        field = field if error.get("loc") else "body"
    if error.get("type") == "extra_forbidden":
        message = f"unknown field {field!r}"
    elif message.startswith(field):
        pass
    else:
        message = f"{field}: {message}"
    return field, message


def validate_image_request(body: Any, limits: ServingLimits) -> ImageGenerationRequest:
    """Validate an image request body (dict or model) against the served model's limits.

    Raises ``ModelNotFoundError`` (404) if ``model`` names another model, and
    ``InvalidRequestError`` (400) listing every problem found, ``param`` set to the first
    offending field (also when the served model generates videos).
    """
    if limits.temporal_factor:
        raise InvalidRequestError(f"model {limits.model_name!r} generates videos; use POST /v1/videos "
                                  "(handle: submit_video)", param="model", code="wrong_endpoint")
    return _validate(ImageGenerationRequest, body, limits)


def validate_video_request(body: Any, limits: ServingLimits) -> VideoGenerationRequest:
    """Validate a video request body (dict or model) against the served model's limits.

    Raises ``ModelNotFoundError`` (404) for another model's name and ``InvalidRequestError``
    (400) listing every problem, ``param`` the first offending field (also when the served
    model generates images only).
    """
    if not limits.temporal_factor:
        raise InvalidRequestError(f"model {limits.model_name!r} generates images; use POST "
                                  "/v1/images/generations (handle: generate)", param="model",
                                  code="wrong_endpoint")
    return _validate(VideoGenerationRequest, body, limits)


def _validate(model_class: type[BaseModel], body: Any, limits: ServingLimits):
    if isinstance(body, BaseModel):
        body = body.model_dump(exclude_unset=True)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param="body")
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise ModelNotFoundError(
            f"model {model!r} is not served here; available: {limits.model_name!r}", param="model",
            code="model_not_found")
    try:
        return model_class.model_validate(body, context={"limits": limits})
    except ValidationError as exc:
        described = [_describe(e, model_class) for e in exc.errors(include_url=False)]
        raise InvalidRequestError("; ".join(m for _, m in described), param=described[0][0],
                                  code="invalid_value") from None


class ImageData(BaseModel):
    """One generated image, a base64-encoded PNG."""

    b64_json: str
    revised_prompt: str | None = None


class ImageGenerationResponse(BaseModel):
    """OpenAI's images response plus the ``ditserve`` metadata block of the design."""

    created: int
    data: list[ImageData]
    ditserve: dict[str, Any]


class VideoJob(BaseModel):
    """A video job as OpenAI's video API shows it (``object: "video"``), plus ``ditserve``.

    ``status``: queued → in_progress → completed | failed. ``progress``: 0–100, the share
    of denoising steps done. ``created_at`` / ``completed_at`` / ``expires_at``: Unix
    seconds. ``seconds``: the video's length (frames / fps) as a string, as OpenAI's field.
    ``error``: ``{"code", "message"}`` when failed.
    """

    id: str
    object: str = "video"
    model: str
    status: str
    progress: int = 0
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    size: str
    seconds: str
    error: dict[str, Any] | None = None
    ditserve: dict[str, Any] = Field(default_factory=dict)
