"""OpenAI's ``POST /v1/images/generations``: the request (plus ditserve's extensions) and the response."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from pipeline.contract.base import GenerationRequest, guidance_scale, limits_of, one_of, validate_body
from pipeline.contract.text import shown
from pipeline.contract.limits import ServingLimits
from pipeline.errors import InvalidRequestError
from pipeline.modes import GuidanceMode
from pipeline.wire import GenerationMetadata

# OpenAI's output_format values (pipeline.media.IMAGE_FORMATS encodes each; the routing
# processes validate without importing the encoders)
OUTPUT_FORMATS = ("png", "jpeg", "webp")
MAX_PARTIAL_IMAGES = 3  # OpenAI's bound on streamed previews


class ImageGenerationRequest(GenerationRequest):
    """Body of ``POST /v1/images/generations`` and argument of the handle's ``generate``.

    ``n``: images, 1..``max_n``. ``true_cfg_scale``: FLUX's true CFG, on when > 1 and a
    ``negative_prompt`` is given (diffusers' rule). ``stream``: answer with OpenAI's image
    streaming events (Server-Sent Events), ``partial_images`` (0..``MAX_PARTIAL_IMAGES``)
    previews first, decoded from the x0-prediction at evenly spaced steps. Validate with
    :func:`validate_image_request`, which applies the served model's limits and reports every
    problem at once.
    """

    # the fields this model's checks across fields read (pipeline.contract.base.checks_across_fields)
    CROSS_CHECKED_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"size", "n", "stream", "partial_images", "output_format", "output_compression"})
    ALLOWED: ClassVar[dict[str, Any]] = {
        "size": GenerationRequest.ALLOWED["size"] + ', or "auto"',
        "n": "an integer from 1 to {limits.max_n}",
        "response_format": "b64_json",
        "output_format": f"one of {', '.join(OUTPUT_FORMATS)}",
        "output_compression": "an integer from 0 to 100 (output_format jpeg or webp)",
        "true_cfg_scale": GenerationRequest.ALLOWED["guidance_scale"],
        "stream": "true or false",
        "partial_images": f"an integer from 0 to {MAX_PARTIAL_IMAGES} (with stream: true)",
        "background": "auto or opaque",
    }

    n: int = 1
    response_format: str = "b64_json"
    output_format: str = "png"
    output_compression: int | None = None
    true_cfg_scale: float | None = Field(default=None, allow_inf_nan=False)
    stream: bool = False
    partial_images: int | None = None
    # OpenAI's; every image is opaque, as each answer says (helper-70: "opaque" was refused). The
    # enum is for the published schema (/openapi.json: clients and bench/fuzz.py draw from it)
    background: str | None = Field(default=None, json_schema_extra={"enum": ["auto", "opaque", None]})

    @field_validator("size", mode="before")
    @classmethod
    def _auto_size(cls, v):
        """OpenAI's ``size: "auto"`` (the model's choice; its SDK default): the server's
        ``limits.default_size``."""
        return None if v == "auto" else v

    @field_validator("partial_images")
    @classmethod
    def _partial_images(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_PARTIAL_IMAGES:
            raise ValueError(f"partial_images must be between 0 and {MAX_PARTIAL_IMAGES}, got {v}")
        return v

    @model_validator(mode="after")
    def _streaming(self) -> "ImageGenerationRequest":
        if self.partial_images and not self.stream:
            raise ValueError("partial_images: previews are sent only with stream: true")
        if self.stream and self.n > 1:
            raise ValueError(f"stream: a streamed request makes one image (n=1), got n={self.n}")
        return self

    @field_validator("n")
    @classmethod
    def _n(cls, v: int, info: ValidationInfo) -> int:
        limits = limits_of(info)
        top = limits.max_n if limits else None
        if v < 1 or (top is not None and v > top):
            raise ValueError(f"n must be between 1 and {top}, got {v}")
        return v

    @field_validator("background")
    @classmethod
    def _background(cls, v: str | None) -> str | None:
        if v == "transparent":
            raise ValueError("background: ditserve's models make opaque images only; send auto or opaque, or leave "
                             "it out")
        return v if v is None else one_of("background", v, ("auto", "opaque"))

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: str) -> str:
        if v != "b64_json":
            raise ValueError(f"response_format must be 'b64_json' (the only format served), got {shown(v)}")
        return v

    @field_validator("output_format")
    @classmethod
    def _output_format(cls, v: str) -> str:
        return one_of("output_format", v, OUTPUT_FORMATS)

    @field_validator("output_compression")
    @classmethod
    def _output_compression(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= 100:
            raise ValueError(f"output_compression must be between 0 and 100, got {v}")
        return v

    @model_validator(mode="after")
    def _compression_needs_a_lossy_format(self) -> "ImageGenerationRequest":
        if self.output_compression is not None and self.output_format == "png":
            raise ValueError("output_compression applies to output_format jpeg or webp, not png (lossless)")
        return self

    @field_validator("true_cfg_scale")
    @classmethod
    def _true_cfg_scale(cls, v: float | None, info: ValidationInfo) -> float | None:
        limits = limits_of(info)
        if v is not None and limits and limits.guidance_style != GuidanceMode.TRUE_CFG:
            raise ValueError(f"true_cfg_scale is not used by {limits.model_name!r}, which guides with guidance_scale "
                             "(CFG on negative_prompt); leave it out")
        return guidance_scale(v, info)

    @model_validator(mode="after")
    def _tokens_split(self, info: ValidationInfo) -> "ImageGenerationRequest":
        self.check_split(limits_of(info), 1)
        return self


def validate_image_request(body: Any, limits: ServingLimits) -> ImageGenerationRequest:
    """Validate an image request body (dict or model) against the served model's limits.

    Raises ``ModelNotFoundError`` (404) if ``model`` names another model, and
    ``InvalidRequestError`` (400) listing every problem found, ``param`` set to the first
    offending field (also when the served model generates videos, or only edits images).
    """
    if limits.temporal_factor:
        raise InvalidRequestError(f"model {limits.model_name!r} generates videos; use POST /v1/videos "
                                  "(handle: submit_video)", param="model", code="wrong_endpoint")
    if limits.requires_image:
        raise InvalidRequestError(f"model {limits.model_name!r} edits images and needs one; use POST "
                                  "/v1/images/edits with an image (handle: edit)", param="model",
                                  code="wrong_endpoint")
    return validate_body(ImageGenerationRequest, body, limits)


class ImageData(BaseModel):
    """One generated image, base64-encoded in the request's ``output_format`` (PNG by default)."""

    b64_json: str
    revised_prompt: str | None = None


class ImageGenerationResponse(BaseModel):
    """OpenAI's images response plus the ``ditserve`` metadata block of the design."""

    created: int
    data: list[ImageData]
    output_format: str = "png"
    size: str | None = None  # "WIDTHxHEIGHT" (pixels) of every image, as OpenAI's ImagesResponse.size
    background: str = "opaque"  # every image is opaque (no transparent background is made)
    ditserve: GenerationMetadata
