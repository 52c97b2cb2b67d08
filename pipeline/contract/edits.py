"""OpenAI's ``POST /v1/images/edits``: the request (plus ditserve's extensions) and its decoding.

Which editing mode a request runs is decided by the served checkpoint and the request
(:func:`edit_mode`): a FLUX.1 Kontext or Qwen-Image-Edit checkpoint edits by reference; a text-to-image FLUX.1
checkpoint runs image-to-image, or inpainting when a ``mask`` is given. The response is the
images response of ``POST /v1/images/generations``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pipeline.contract.base import file_bytes, limits_of, step_problems, validate_body
from pipeline.contract.images import ImageGenerationRequest
from pipeline.contract.limits import ServingLimits, parse_size
from pipeline.contract.uploads import alpha_of, auto_size, fitted, open_image, to_rgb
from pipeline.errors import InvalidRequestError
from pipeline.modes import InputMode
from pipeline.wire import ImageArray

EDIT_MODES = (InputMode.IMAGE_TO_IMAGE, InputMode.INPAINT, InputMode.REFERENCE)  # what /v1/images/edits runs


def strength_problem(v: float | None) -> str | None:
    """Why ``strength`` is out of (0, 1], or None."""
    if v is not None and not 0.0 < v <= 1.0:
        return f"strength must be in (0, 1] (the fraction of the steps that re-noise the image), got {v}"
    return None


def effective_steps(num_inference_steps: int, strength: float | None) -> int:
    """Steps that actually run for ``strength`` (diffusers' ``get_timesteps`` of
    ``FluxImg2ImgPipeline``: the first ``int(N − N·strength)`` of N are skipped)."""
    if strength is None:
        return num_inference_steps
    init = min(num_inference_steps * strength, num_inference_steps)
    return num_inference_steps - int(max(num_inference_steps - init, 0))


class ImageEditRequest(ImageGenerationRequest):
    """Body of ``POST /v1/images/edits`` (a multipart form) and argument of the handle's ``edit``.

    ``image``: the input image file(s) as bytes (PNG, JPEG or WebP), one or a list (the form's
    ``image[]``), at most ``max_input_images``. ``mask``: a PNG whose fully transparent pixels
    (alpha 0) mark the region to repaint, the image's size (inpainting). ``strength`` in (0, 1]:
    the share of the steps that re-noise the input (image-to-image and inpainting; 1.0 repaints
    from noise); default ``limits.default_strength`` for image-to-image, 1.0 for inpainting.
    ``size``: the output size; when left out or ``"auto"``, the first image's own size (scaled
    down to ``max_pixels`` and rounded down to the model's multiple). Every other field is
    ``POST /v1/images/generations``'.
    """

    steps_follow_strength: ClassVar[bool] = True
    CROSS_CHECKED_FIELDS: ClassVar[frozenset[str]] = ImageGenerationRequest.CROSS_CHECKED_FIELDS | {
        "mask", "strength", "num_inference_steps", "cache_dit_params"}  # _mode's

    ALLOWED: ClassVar[dict[str, Any]] = {
        "size": '"WIDTHxHEIGHT" in pixels, each a multiple of {limits.spatial_factor}, at most {limits.max_pixels} '
                'pixels, or "auto" (default: the image\'s own size)',  # (helper-62: it said default 64x64)
        "image": "an image file (PNG, JPEG or WebP), or a list of at most {limits.max_input_images}",
        "mask": "a PNG file of the image's size, its fully transparent pixels to repaint",
        "strength": "a number in (0, 1]",
    }

    image: bytes | list[bytes] = Field(repr=False)
    mask: bytes | None = Field(default=None, repr=False)
    strength: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("image", mode="before")
    @classmethod
    def _image_buffers(cls, v: object) -> object:
        """bytes-like buffers, and a tuple of files as a list (a handle caller's)."""
        return [file_bytes(one) for one in v] if isinstance(v, (list, tuple)) else file_bytes(v)

    @field_validator("mask", mode="before")
    @classmethod
    def _mask_buffer(cls, v: object) -> object:
        return file_bytes(v)

    @field_validator("image")
    @classmethod
    def _image(cls, v: bytes | list[bytes], info: ValidationInfo) -> list[bytes]:
        images = [v] if isinstance(v, bytes) else list(v)
        if not images:
            raise ValueError("image: at least one image file is required")
        limits = limits_of(info)
        top = limits.max_input_images if limits else None
        if top is not None and len(images) > top:
            raise ValueError(f"image: {len(images)} images given; this model takes at most {top}")
        return images

    @field_validator("size", mode="before")
    @classmethod
    def _auto_size(cls, v):
        """OpenAI's ``size: "auto"`` (its default for edits): the image's own size."""
        return None if v == "auto" else v

    @model_validator(mode="after")
    def _tokens_split(self, info: ValidationInfo) -> "ImageEditRequest":
        """A given ``size`` must split across the ranks; without one the image's own size is
        checked once decoded (``pipeline.sampling.resolve_edit``)."""
        if self.size is not None:
            self.check_split(limits_of(info), 1)
        return self

    @field_validator("strength")
    @classmethod
    def _strength(cls, v: float | None) -> float | None:
        problem = strength_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _mode(self, info: ValidationInfo) -> "ImageEditRequest":
        limits = limits_of(info)
        if limits:
            mode = edit_mode(self, limits)
            if mode == InputMode.REFERENCE and self.strength is not None:
                raise ValueError("strength: reference editing (FLUX.1 Kontext, Qwen-Image-Edit) runs every step "
                                 "from noise; leave strength out")
            steps = self.num_inference_steps or limits.default_steps
            strength = self.strength if self.strength is not None else default_strength(mode, limits)
            run = effective_steps(steps, strength)
            if run < 1:
                raise ValueError(f"strength: {strength:g} of {steps} num_inference_steps leaves no step to run; "
                                 "raise strength or num_inference_steps")
            problems = step_problems(self.cache_dit_params, limits, run) if self.cache_dit_params else []
            if problems:  # Cache-DiT is sized for the steps that run (strength < 1 runs fewer)
                raise ValueError("; ".join(p + strength_runs(strength, run, steps) for p in problems))
        return self


def strength_runs(strength: float | None, run: int, steps: int) -> str:
    """`` (strength 0.5 runs 4 of the 8 steps)`` after a message about the ``run`` steps an
    edit's ``strength`` leaves of its ``steps``; empty when every step runs."""
    return "" if run == steps else f" (strength {strength:g} runs {run} of the {steps} steps)"


def default_strength(mode: InputMode, limits: ServingLimits) -> float | None:
    """A mode's ``strength`` when the request gives none (None: the mode has no strength)."""
    return {InputMode.IMAGE_TO_IMAGE: limits.default_strength, InputMode.INPAINT: 1.0}.get(mode)


def edit_mode(request: ImageEditRequest, limits: ServingLimits) -> InputMode:
    """The editing mode of ``request`` on this model: reference editing where the model serves
    it, else inpainting with a ``mask``, else image-to-image. Raises ``ValueError`` (400,
    naming the field) when the model serves no such mode."""
    served = [m for m in limits.input_modes if m in EDIT_MODES]
    if not served:
        raise ValueError(f"image: model {limits.model_name!r} does not serve image edits (it serves "
                         f"{', '.join(limits.input_modes) or 'text-to-' + ('video' if limits.temporal_factor else 'image')})")
    if InputMode.REFERENCE in served:
        if request.mask is not None:
            raise ValueError(f"mask: model {limits.model_name!r} edits by reference (FLUX.1 Kontext, "
                             "Qwen-Image-Edit) and does not inpaint; leave mask out")
        return InputMode.REFERENCE
    wanted = InputMode.INPAINT if request.mask is not None else InputMode.IMAGE_TO_IMAGE
    if wanted not in served:
        raise ValueError(f"{'mask' if request.mask is not None else 'image'}: model {limits.model_name!r} does not "
                         f"serve {wanted.value.replace('_', '-')} (it serves {', '.join(served)})")
    return wanted


def validate_edit_request(body: Any, limits: ServingLimits) -> ImageEditRequest:
    """Validate an edit body (dict or model; images as bytes) against the served model's limits.

    Raises ``ModelNotFoundError`` (404) for another model's name and ``InvalidRequestError``
    (400) listing every problem, ``param`` the first offending field. The images are decoded
    by :func:`decode_edit_inputs`.
    """
    if limits.temporal_factor:
        raise InvalidRequestError(f"model {limits.model_name!r} generates videos; animate an image with POST "
                                  "/v1/videos and input_reference", param="model", code="wrong_endpoint")
    return validate_body(ImageEditRequest, body, limits)


def decode_edit_inputs(request: ImageEditRequest, limits: ServingLimits
                       ) -> tuple[int, int, tuple[ImageArray, ...], ImageArray | None]:
    """Decode and check a validated edit's uploads: ``(width, height, images, mask)`` with
    every image RGB at the output size and the mask (its alpha) likewise. The output size is
    ``size`` or the first image's (:func:`pipeline.contract.uploads.auto_size`). Raises
    ``InvalidRequestError`` naming ``image`` or ``mask``."""
    opened = [open_image(data, "image", limits.max_input_pixels) for data in request.image]
    if request.size is not None:
        width, height = parse_size(request.size)
    else:
        width, height = auto_size(*opened[0].size, limits.spatial_factor, limits.max_pixels)
    images = tuple(fitted(to_rgb(image, "image"), width, height) for image in opened)
    mask = None
    if request.mask is not None:
        mask_image = open_image(request.mask, "mask", limits.max_input_pixels)
        if mask_image.size != opened[0].size:
            raise InvalidRequestError(f"mask: the mask is {mask_image.size[0]}x{mask_image.size[1]} but the image is "
                                      f"{opened[0].size[0]}x{opened[0].size[1]}; they must be the same size",
                                      param="mask", code="invalid_mask")
        mask = fitted(alpha_of(mask_image), width, height, mask=True)
    return width, height, images, mask


def decode_reference(data: bytes, width: int, height: int, limits: ServingLimits, field: str) -> ImageArray:
    """One uploaded conditioning image (``input_reference``) as RGB at ``width`` × ``height``."""
    return fitted(to_rgb(open_image(data, field, limits.max_input_pixels), field), width, height)
