"""OpenAI's ``POST /v1/videos`` jobs: the request (plus ditserve's extensions), the job object, and
``GET /v1/videos``'s page of jobs with its query parameters."""

from __future__ import annotations

import numbers
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_serializer, model_validator

from pipeline.contract.base import GenerationRequest, file_bytes, guidance_scale, limits_of, validate_body
from pipeline.contract.text import shown
from pipeline.contract.limits import ServingLimits
from pipeline.errors import InvalidRequestError
from pipeline.modes import DualMode, InputMode, StrEnum
from pipeline.wire import AccelerationReport

MAX_SECONDS = 3600  # a bound before frames are computed; limits.max_frames is the real cap
SECONDS_RE = re.compile(r"[0-9]{1,4}")  # ASCII digits only, as size's; OpenAI's VideoSeconds: "4", "8", "12"


def frames_of(seconds: int, fps: int, limits: ServingLimits) -> int:
    """The frames ``seconds`` at ``fps`` make: ``temporal_factor · round(seconds · fps /
    temporal_factor) + 1`` (at least one latent step)."""
    factor = max(limits.temporal_factor, 1)
    return factor * max(1, round(seconds * fps / factor)) + 1


class VideoGenerationRequest(GenerationRequest):
    """Body of ``POST /v1/videos`` and argument of the handle's ``submit_video``.

    ``seconds`` (OpenAI's field: a whole number of seconds in ASCII digits, 1 to ``MAX_SECONDS``,
    as a string or integer; OpenAI's own values are "4", "8", "12") or ``num_frames`` set the
    length: ``seconds`` becomes ``temporal_factor · round(seconds · fps / temporal_factor) + 1``
    frames; ``num_frames`` must already be of that form (Wan: 4k + 1). ``fps``: frames per
    second of the MP4. ``guidance_scale_2`` (guidance of the low-noise expert) and
    ``boundary_ratio`` (in [0, 1], the fraction of ``num_train_timesteps`` below which the
    second expert runs) apply to boundary-expert models (Wan 2.2 A14B) only.
    ``input_reference``: an image file (bytes: PNG, JPEG or WebP; OpenAI's multipart field) that
    becomes the first frame (image-to-video, on models that serve it: Wan 2.2-style latent
    conditioning); it is scaled to cover ``size`` and centre-cropped.
    """

    # the fields this model's checks across fields read (pipeline.contract.base.checks_across_fields)
    CROSS_CHECKED_FIELDS: ClassVar[frozenset[str]] = frozenset({"size", "seconds", "num_frames", "fps"})
    ALLOWED: ClassVar[dict[str, Any]] = {
        "seconds": f"a whole number of seconds from 1 to {MAX_SECONDS}, as an integer or a string of digits",
        "num_frames": "an integer {limits.temporal_factor}·k + 1, at most {limits.max_frames} "
                      "(default {limits.default_num_frames})",
        "fps": "an integer from 1 to 120 (default {limits.default_fps})",
        "guidance_scale_2": GenerationRequest.ALLOWED["guidance_scale"],
        "boundary_ratio": "a number in [0, 1]",
        "input_reference": "an uploaded image file (PNG, JPEG or WebP)",
    }

    seconds: int | str | None = None
    num_frames: int | None = None
    fps: int | None = None
    guidance_scale_2: float | None = Field(default=None, allow_inf_nan=False)
    boundary_ratio: float | None = Field(default=None, allow_inf_nan=False)
    input_reference: bytes | None = Field(default=None, repr=False)

    @field_validator("input_reference", mode="before")
    @classmethod
    def _input_reference_upload(cls, v: object) -> object:
        """Only an uploaded file: OpenAI's JSON forms (``{"image_url": ...}``, ``{"file_id": ...}``)
        were refused as 'Input should be a valid bytes'."""
        v = file_bytes(v)
        if v is not None and not isinstance(v, bytes):
            raise ValueError("input_reference takes an uploaded image file (a multipart form field, as the SDK "
                             f"sends a file); {type(v).__name__} given (image_url and file_id are not served)")
        return v

    @field_validator("input_reference")
    @classmethod
    def _input_reference(cls, v: bytes | None, info: ValidationInfo) -> bytes | None:
        limits = limits_of(info)
        if v is not None and limits and InputMode.IMAGE_TO_VIDEO not in limits.input_modes:
            raise ValueError(f"input_reference: model {limits.model_name!r} does not serve image-to-video "
                             "(a WanImageToVideoPipeline checkpoint does)")
        return v

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, v: object) -> int | None:
        if v is None:
            return v
        text = str(v) if type(v) is int else v  # not bool, not float: 1e-300 or 2.5 seconds are refused
        if not isinstance(text, str) or not SECONDS_RE.fullmatch(text) or not 1 <= int(text) <= MAX_SECONDS:
            raise ValueError(f"seconds must be a whole number of seconds in ASCII digits, 1 to {MAX_SECONDS} "
                             f"(OpenAI's values are 4, 8 and 12; num_frames sets other lengths), got {shown(v)}")
        return int(text)

    @field_validator("fps")
    @classmethod
    def _fps(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= 120:
            raise ValueError(f"fps must be between 1 and 120, got {v}")
        return v

    @field_validator("guidance_scale_2", "boundary_ratio")
    @classmethod
    def _boundary_fields(cls, v: float | None, info: ValidationInfo) -> float | None:
        limits = limits_of(info)
        if v is not None and limits and limits.dual_mode != DualMode.BOUNDARY:
            raise ValueError(f"{info.field_name} applies to models with boundary experts (Wan 2.2 A14B); "
                             f"{limits.model_name!r} has none")
        if info.field_name == "boundary_ratio":
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(f"boundary_ratio must be in [0, 1], got {v}")
            return v
        return guidance_scale(v, info)

    def _seconds_that_fit(self, limits: ServingLimits) -> str:
        """`` (at most N seconds at F fps)`` for a ``seconds`` past ``max_frames`` (helper-59: the
        400 named frames only); empty for ``num_frames``."""
        if self.seconds is None:
            return ""
        fps = self.fps or limits.default_fps
        fit = [s for s in range(1, limits.max_frames // fps + 2) if frames_of(s, fps, limits) <= limits.max_frames]
        return (f" (at most {max(fit)} seconds at {fps} fps)" if fit
                else f" (no whole second fits at {fps} fps: give num_frames, or a lower fps)")

    def frames(self, limits: ServingLimits) -> int:
        """The frame count this request asks for (before the limit checks)."""
        if self.num_frames is not None:
            return self.num_frames
        if self.seconds is not None:
            return frames_of(self.seconds, self.fps or limits.default_fps, limits)
        return limits.default_num_frames

    @model_validator(mode="after")
    def _length(self, info: ValidationInfo) -> "VideoGenerationRequest":
        limits = limits_of(info)
        if self.seconds is not None and self.num_frames is not None:
            raise ValueError("seconds: give either seconds or num_frames, not both")
        if not limits:
            return self
        frames = self.frames(limits)
        given = "num_frames" if self.num_frames is not None else "seconds" if self.seconds is not None else None
        field = given or "num_frames"  # the field that sets the frames (neither given: the default's)
        factor = limits.temporal_factor
        if frames < 1 or (factor and (frames - 1) % factor):
            raise ValueError(f"num_frames must be {factor}·k + 1 (the VAE's temporal factor is {factor}), "
                             f"e.g. {factor + 1}, {2 * factor + 1}, {4 * factor + 1}; got {frames}")
        if frames > limits.max_frames:
            raise ValueError(f"{field}: {frames} frames requested; at most {limits.max_frames} are allowed"
                             + self._seconds_that_fit(limits))
        latent_frames = (frames - 1) // max(factor, 1) + 1
        if limits.max_latent_frames and latent_frames > limits.max_latent_frames:
            most = (limits.max_latent_frames - 1) * max(factor, 1) + 1
            raise ValueError(f"{field}: {frames} frames are {latent_frames} latent frames; this model's position "
                             f"table covers {limits.max_latent_frames} (at most {most} frames)")
        self.check_split(limits, latent_frames, given)
        return self


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
    return validate_body(VideoGenerationRequest, body, limits)


class JobStatus(StrEnum):
    """A video job's life: queued → in_progress → completed | failed (OpenAI's values)."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"


class VideoJobMetadata(BaseModel):
    """The job's ``ditserve`` block: its frames, fps and seed from the start; the batch, timings
    and accelerations (as :class:`pipeline.wire.GenerationMetadata`) once it has run."""

    num_frames: int
    fps: int
    seed: int
    request_id: str | None = None
    batch_id: str | None = None
    batch_size: int | None = None
    signature: str | None = None
    replica: str | None = None
    world_size: int | None = None
    state_change: bool | None = None
    timings_ms: dict[str, float] | None = None
    acceleration: AccelerationReport | None = None

    @model_serializer(mode="wrap")
    def _omit_unknown(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class VideoJob(BaseModel):
    """A video job as OpenAI's video API shows it (``object: "video"``), plus ``ditserve``.

    ``status``: queued → in_progress → completed | failed. ``progress``: 0–100, the share
    of denoising steps done. ``created_at`` / ``completed_at`` / ``expires_at``: Unix
    seconds. ``seconds``: the video's length (frames / fps) as a string, as OpenAI's field.
    ``error``: ``{"code", "message"}`` when failed. ``prompt``: the request's prompt (OpenAI's
    field; it was never filled, helper-77).
    """

    id: str
    object: str = "video"
    model: str
    status: JobStatus
    progress: int = 0
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    size: str
    seconds: str
    error: dict[str, Any] | None = None
    prompt: str | None = None
    ditserve: VideoJobMetadata


class ListOrder(StrEnum):
    """``GET /v1/videos``'s ``order``: by ``created_at``, oldest (``asc``) or newest (``desc``) first."""

    ASC = "asc"
    DESC = "desc"


LIST_LIMIT_DEFAULT = 20  # OpenAI's list endpoints' default page
LIST_LIMIT_MAX = 100  # OpenAI's documented maximum for videos.list (its minimum is 0)
LIST_PARAMS = ("after", "limit", "order")  # GET /v1/videos's query parameters (OpenAI's)


def validate_list_params(limit: int | str | None = None,
                         order: ListOrder | str | None = None) -> tuple[int, ListOrder]:
    """``GET /v1/videos``'s ``limit`` (an int, or a query string's decimal digits; 0 to
    :data:`LIST_LIMIT_MAX`, default :data:`LIST_LIMIT_DEFAULT`) and ``order`` (``asc`` | ``desc``,
    default ``desc``) as ``(limit, order)``. ``after`` is checked where the jobs are (the Router).
    Raises ``InvalidRequestError`` (400) naming every bad one, ``param`` the first."""
    problems = []
    if limit is None:
        count = LIST_LIMIT_DEFAULT
    elif isinstance(limit, str):
        count = int(limit) if re.fullmatch(r"-?[0-9]{1,9}", limit) else None
    else:  # a handle caller's numpy integer too, as in request bodies (json_like; helper-77)
        count = int(limit) if isinstance(limit, numbers.Integral) and not isinstance(limit, bool) else None
    if count is None or not 0 <= count <= LIST_LIMIT_MAX:
        problems.append(("limit", f"limit must be an integer from 0 to {LIST_LIMIT_MAX}, got {shown(limit)}"))
    if order is not None and order not in tuple(ListOrder):
        problems.append(("order", f"order must be one of {', '.join(ListOrder)} (by created_at), got {shown(order)}"))
    if problems:
        raise InvalidRequestError("; ".join(m for _, m in problems), param=problems[0][0], code="invalid_value")
    return count, ListOrder(order or ListOrder.DESC)


class VideoList(BaseModel):
    """A page of ``GET /v1/videos`` (OpenAI's cursor page): ``data`` in the requested order,
    ``first_id`` / ``last_id`` its first and last job's id (None on an empty page; the next page
    is ``after=last_id``, as OpenAI's SDK pages), ``has_more`` whether jobs follow it."""

    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
