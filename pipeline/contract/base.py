"""Fields and checks every generation request shares, and the one place errors are described.

The OpenAI SDK merges ``extra_body`` into the top level; a literal nested ``extra_body``
object is merged too. Unknown top-level fields are rejected so a typo never passes silently.
Validation reports every problem at once: one :class:`InvalidRequestError` whose ``param``
is the first offending top-level field and whose message names each field by its dotted path
(``cache_dit_params.Fn_compute_blocks``).
"""

from __future__ import annotations

import functools
import math
import numbers
import re
import sys
from typing import Any, ClassVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from parallel.kernels import kernel_names
from pipeline.cache_dit_params import DEFAULT_FN_COMPUTE_BLOCKS, DEFAULT_MAX_WARMUP_STEPS, CacheDiTKnobs, CacheDiTParams
from pipeline.contract.limits import (MAX_GUIDANCE_SCALE, ServingLimits, encoding_problem, parse_size, size_problem,
                                      split_problem)
from pipeline.contract.lora import LoraRequest, adapter_model_id, split_model
from pipeline.contract.text import did_you_mean, shown, text_problem
from pipeline.errors import InvalidRequestError, ModelNotFoundError
from pipeline.modes import DualMode, GuidanceMode, Priority

MAX_BODY_DEPTH = 6        # the deepest legitimate body: cache_dit_params.secondary.<knob> (3 levels)
MAX_ERRORS_LISTED = 8     # problems listed in one message, then "and N more"
MAX_SHORT_TEXT = 256      # ``user``, ``model`` and other short strings
EDIT_FILES = ("image", "mask")  # OpenAI's images.edit uploads
VIDEO_FILES = ("input_reference",)  # OpenAI's videos.create upload
FILE_FIELDS = frozenset(EDIT_FILES + VIDEO_FILES)  # file bytes (multipart uploads; through a handle, bytes)


def limits_of(info: ValidationInfo) -> ServingLimits | None:
    """The ``ServingLimits`` a request is validated against (None: static checks only)."""
    return (info.context or {}).get("limits")


def file_bytes(v: object) -> object:
    """An uploaded file's value as ``bytes``: a handle caller's ``bytearray`` or ``memoryview``
    is copied to ``bytes`` (the strict models took ``bytes`` only); other values unchanged,
    for the field's own check to name."""
    return bytes(v) if isinstance(v, (bytearray, memoryview)) else v


def non_negative(v: float | None, info: ValidationInfo) -> float | None:
    """A pydantic field check: ``v`` finite and >= 0 (None passes); raises ``ValueError`` naming the field."""
    if v is not None and (not math.isfinite(v) or v < 0):
        raise ValueError(f"{info.field_name} must be a finite number >= 0, got {v}")
    return v


def guidance_scale(v: float | None, info: ValidationInfo) -> float | None:
    """A guidance scale: finite, in [0, MAX_GUIDANCE_SCALE] (None passes); raises ``ValueError``
    naming the field."""
    non_negative(v, info)
    if v is not None and v > MAX_GUIDANCE_SCALE:
        raise ValueError(f"{info.field_name} must be at most {MAX_GUIDANCE_SCALE:g}, got {v}")
    return v


def _ranges(values) -> str:
    """Sorted step counts as short text: ``4, 6 or 8..100``."""
    values, parts, start = sorted(values), [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}, {v}" if v == start + 1 else f"{start}..{v}")
            start = None
    return ", ".join(parts[:-1]) + (" or " if len(parts) > 1 else "") + parts[-1] if parts else "none"


def _tokenizable(field: str, value: str, limits: ServingLimits | None) -> str:
    """``value`` if it is text the tokenizers take (bounded length first, then ``text_problem``)."""
    if limits and len(value) > limits.max_prompt_chars:
        raise ValueError(f"{field} has {len(value)} characters; at most {limits.max_prompt_chars} are allowed")
    problem = text_problem(field, value, limits.special_tokens if limits else ())
    if problem:
        raise ValueError(problem)
    return value


def one_of(field: str, value, allowed: tuple[str, ...]):
    """``value`` when it is one of ``allowed``; else ``ValueError`` naming ``field`` and the
    allowed values."""
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(allowed)}, got {shown(value)}")
    return value


def step_problems(params: CacheDiTParams, limits: ServingLimits, steps: int) -> list[str]:
    """What in ``cache_dit_params`` does not fit a run of ``steps`` denoising steps (warmup and
    continuous-cache bounds, SCM bins and presets): one message per problem."""
    problems: list[str] = []
    for where, knobs in _knob_sets(params):
        for knob in ("max_warmup_steps", "max_continuous_cached_steps"):
            value = getattr(knobs, knob)
            if value is not None and value > steps:
                problems.append(f"{where}.{knob} must be at most num_inference_steps ({steps}), got {value}")
    if params.scm_compute_bins is not None:
        for name in ("scm_compute_bins", "scm_cache_bins"):
            if len(getattr(params, name)) > steps:
                problems.append(f"cache_dit_params.{name} has {len(getattr(params, name))} bins; at most "
                                f"num_inference_steps ({steps})")
        covered = sum(params.scm_compute_bins) + sum(params.scm_cache_bins)
        if covered < steps:
            problems.append(f"cache_dit_params: scm_compute_bins + scm_cache_bins cover {covered} steps, "
                            f"fewer than num_inference_steps={steps}")
    preset = params.scm_preset
    valid = limits.scm_preset_steps.get(preset) if preset not in (None, "none") else None
    if valid is not None and steps not in valid:
        problems.append(f"cache_dit_params.scm_preset {preset!r} needs num_inference_steps in "
                        f"{_ranges(valid)} (cache-dit's masks), got {steps}")
    return problems


def cache_dit_problems(params: CacheDiTParams, limits: ServingLimits, steps: int | None) -> list[str]:
    """What in ``cache_dit_params`` does not fit the model and a run of ``steps`` denoising
    steps (None: the steps are not known yet, only the model is checked): ``secondary`` only
    for models with two transformers, Fn + Bn within the model's blocks (an unset
    ``Fn_compute_blocks`` is cache-dit's default, 8; cache-dit asserts each within the blocks, and
    a sum past them would compute blocks twice), then :func:`step_problems`. One message per
    problem. Knobs that fit but would cache nothing: :func:`nothing_cached_problems`."""
    problems = []
    if params.secondary is not None and limits.dual_mode == DualMode.SINGLE:
        problems.append("cache_dit_params.secondary is only for models with two transformers; "
                        f"{limits.model_name!r} has one")
    for where, used, unset in _blocks_used(params) if limits.num_blocks else ():
        if used > limits.num_blocks:
            longest = limits.longest_block_list or limits.num_blocks
            lists = " in its shorter block list (cache-dit caches each apart)" if longest > limits.num_blocks else ""
            problems.append(f"{where}: Fn_compute_blocks + Bn_compute_blocks = {used} exceeds the model's "
                            f"{limits.num_blocks} transformer blocks{lists} (at most "
                            f"{min(limits.num_blocks, longest - 1)}){unset}")
    if steps is not None:
        problems += step_problems(params, limits, steps)
    return problems


def _knob_sets(params: CacheDiTParams) -> list[tuple[str, CacheDiTKnobs]]:
    """(field path, knobs) of the primary transformer and, where given, of ``secondary``."""
    return [(where, knobs) for where, knobs in (("cache_dit_params", params),
                                                ("cache_dit_params.secondary", params.secondary)) if knobs is not None]


def _blocks_used(params: CacheDiTParams) -> list[tuple[str, int, str]]:
    """(field path, Fn + Bn, a note when Fn is cache-dit's default) per transformer the knobs set."""
    used = []
    for where, name in (("cache_dit_params", "transformer"), ("cache_dit_params.secondary", "transformer_2")):
        if name == "transformer" or params.secondary is not None:
            knobs = params.for_transformer(name)
            fn = knobs.Fn_compute_blocks or DEFAULT_FN_COMPUTE_BLOCKS
            unset = "" if knobs.Fn_compute_blocks else f" (Fn_compute_blocks unset: cache-dit's {fn})"
            used.append((where, fn + (knobs.Bn_compute_blocks or 0), unset))
    return used


def nothing_cached_problems(params: CacheDiTParams, limits: ServingLimits, steps: int | None) -> list[str]:
    """Knobs that fit (:func:`cache_dit_problems` found nothing) but with which cache-dit would
    cache none of ``steps`` denoising steps (None: only the model is checked), an unset knob
    being cache-dit's default: Fn + Bn reaching the blocks of its longest list (a "cached" step
    would compute them all), a 1-step run (its first step has nothing to reuse), explicit SCM bins
    computing every step, a warmup (cache-dit's 8 when unset) covering every step without an SCM
    mask (a mask shortens it to its first computed steps), ``max_continuous_cached_steps`` 0 but
    under a static mask (which caches whatever that limit says; cache-dit's
    ``cache_manager.can_cache`` and ``cache_context.warmup_steps``). A request's knobs are checked
    only where Cache-DiT runs (one that turns it off may keep them); the server's default knobs
    wherever a request may turn it on (the Ingress). A boundary-expert model's experts each run a
    share of the steps, which is not known here: they are checked against all of them."""
    problems = []
    longest = limits.longest_block_list or limits.num_blocks
    for where, used, unset in _blocks_used(params) if limits.num_blocks else ():
        if longest <= used <= limits.num_blocks:
            problems.append(f"{where}: Fn_compute_blocks + Bn_compute_blocks = {used} leaves no block to cache of "
                            f"the model's {longest} transformer blocks (at most {longest - 1}: a cached step reuses "
                            f"the blocks between them){unset}")
    static = params.has_mask and params.scm_policy == "static"
    for where, knobs in _knob_sets(params):
        if knobs.max_continuous_cached_steps == 0 and not static:
            problems.append(f"{where}.max_continuous_cached_steps must be -1 (no limit) or at least 1, got 0: 0 caches "
                            "no step, except under a static SCM mask (scm_policy: static)")
    if steps is None:
        return problems
    if steps == 1:
        return [*problems, "num_inference_steps: a run of 1 step leaves Cache-DiT no step to cache (its first step "
                           "has nothing to reuse; it needs at least 2)"]
    if params.scm_compute_bins is not None and params.scm_compute_bins[0] >= steps:
        problems.append(f"cache_dit_params.scm_compute_bins: its first bin computes {params.scm_compute_bins[0]} "
                        f"steps, covering all {steps} that run, so none would be cached (at most {steps - 1})")
    for where, knobs in _knob_sets(params):
        warmup = knobs.max_warmup_steps
        if params.has_mask or (warmup is None and knobs is not params) or (warmup or 0) > steps:
            continue  # a mask shortens the warmup; a warmup past the steps is cache_dit_problems'
        if (DEFAULT_MAX_WARMUP_STEPS if warmup is None else warmup) >= steps:
            given = f"unset: cache-dit's {DEFAULT_MAX_WARMUP_STEPS}" if warmup is None else str(warmup)
            problems.append(f"{where}.max_warmup_steps ({given}) must be below the {steps} steps that run (at most "
                            f"{steps - 1}): warmup steps are never cached, so none would be (an SCM mask, "
                            "scm_preset, shortens the warmup)")
    return problems


@functools.cache
def _optional_fields(model: type[BaseModel]) -> frozenset[str]:
    """``model``'s fields that have a default (``extra_body`` too: ``null`` is no nested body)."""
    return frozenset({"extra_body", *(name for name, field in model.model_fields.items() if not field.is_required())})


def _without_nulls(model: type[BaseModel], data: dict) -> dict:
    """``data`` without the optional fields given ``null`` (a required one stays: its error names it)."""
    return {k: v for k, v in data.items() if v is not None or k not in _optional_fields(model)}


class GenerationRequest(BaseModel):
    """Fields and checks shared by image and video requests (see ``images`` and ``videos``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    # Requests whose run is shorter than num_inference_steps (strength) check the step-dependent
    # Cache-DiT knobs after validation, against the steps that actually run.
    steps_follow_strength: ClassVar[bool] = False
    # What each field takes, named in a 400 whose value pydantic refused by type (a string for
    # an integer; ``describe_error``): text, ``{limits.<field>}`` filled from the served model's
    # limits, or a function of the limits. Subclasses add theirs; a test checks every field has one.
    ALLOWED: ClassVar[dict[str, Any]] = {
        "prompt": "a non-empty string of at most {limits.max_prompt_chars} characters",
        "model": lambda limits: f"one of {served_models(limits)}",
        "size": '"WIDTHxHEIGHT" in pixels, each a multiple of {limits.spatial_factor}, at most {limits.max_pixels} '
                'pixels (default {limits.default_width}x{limits.default_height})',
        "user": f"a string of at most {MAX_SHORT_TEXT} characters",
        "safety_identifier": f"a string of at most {MAX_SHORT_TEXT} characters",
        "negative_prompt": "a string of at most {limits.max_prompt_chars} characters",
        "num_inference_steps": "an integer from {limits.min_steps} to {limits.max_steps} "
                               "(default {limits.default_steps})",
        "guidance_scale": f"a number from 0 to {MAX_GUIDANCE_SCALE:g}",
        "seed": "an integer from 0 to 2**63 - 1",
        "enable_cache_dit": "true or false",
        "cache_dit_params": "an object of Cache-DiT knobs: " + ", ".join(CacheDiTParams.model_fields),
        "cfg_gate_step": "a number in (0, 1] (1.0: no gating)",
        "attention_backend_override": lambda limits: "one of " + ", ".join(  # those that run here (helper-61)
            k for k in kernel_names() if not limits.attention_rejections.get(k)),
        "timeout_s": "a number of seconds > 0 and <= {limits.max_timeout_s:g}",
        "priority": f"one of {', '.join(Priority)}",
        "lora": 'a list of at most {limits.max_loras} objects {{"name": adapter, "scale": number}}',
    }

    prompt: str
    model: str | None = Field(default=None, max_length=MAX_SHORT_TEXT)
    size: str | None = None
    # OpenAI's end-user identifiers (safety_identifier replaces the deprecated user): taken, unused
    user: str | None = Field(default=None, max_length=MAX_SHORT_TEXT)
    safety_identifier: str | None = Field(default=None, max_length=MAX_SHORT_TEXT)
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = Field(default=None, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    enable_cache_dit: bool | None = None
    cache_dit_params: CacheDiTParams | None = None
    cfg_gate_step: float | None = Field(default=None, allow_inf_nan=False)
    attention_backend_override: str | None = None
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    priority: str | None = None
    lora: list[LoraRequest] | None = None

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        """A literal nested ``extra_body`` object is merged into the top level (``null``: none);
        then ``null`` means a field's default, as in OpenAI's API (``n``, ``stream``,
        ``output_format``, ... are nullable there; the SDK sends ``None`` as ``null``)."""
        if not isinstance(data, dict):
            return data
        data = _without_nulls(cls, data)
        if "extra_body" in data:
            nested = data.pop("extra_body")
            if not isinstance(nested, dict):
                raise ValueError(f"extra_body must be an object of request fields (or null), got {shown(nested)}")
            nested = _without_nulls(cls, nested)
            if "extra_body" in nested:  # the SDK's extra_body sent as a field of itself
                raise ValueError("extra_body holds an extra_body: one level is merged into the top level; put its "
                                 "fields in the one extra_body")
            clash = sorted(set(nested) & set(data))
            if clash:
                raise ValueError(f"extra_body repeats top-level field(s) {', '.join(clash)}")
            data.update(nested)
        return data

    @field_validator("priority")
    @classmethod
    def _priority(cls, v: str | None) -> str | None:
        return v if v is None else one_of("priority", v, tuple(Priority))

    @field_validator("lora")
    @classmethod
    def _lora(cls, v: list[LoraRequest] | None, info: ValidationInfo) -> list[LoraRequest] | None:
        """At most ``max_loras`` adapters, each named once (registration is checked by
        :func:`validate_body`: an unknown adapter is a 404)."""
        if v is None:
            return v
        limits = limits_of(info)
        top = limits.max_loras if limits else None
        if top is not None and len(v) > top:
            raise ValueError(f"lora lists {len(v)} adapters; at most {top} are allowed (limits.max_loras)")
        names = [item.name for item in v]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"lora names adapter(s) {', '.join(map(repr, repeated))} more than once")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str, info: ValidationInfo) -> str:
        if not v.strip():
            raise ValueError("prompt must not be empty")
        return _tokenizable("prompt", v, limits_of(info))

    @field_validator("negative_prompt")
    @classmethod
    def _negative_prompt(cls, v: str | None, info: ValidationInfo) -> str | None:
        limits = limits_of(info)
        if v is not None:
            _tokenizable("negative_prompt", v, limits)
        if v is not None and limits and limits.guidance_style == GuidanceMode.AUTOGUIDANCE:
            raise ValueError("negative_prompt is not used by this paired-transformer model (its second "
                             "transformer guides from the prompt itself); leave it out")
        return v

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        width, height = parse_size(v)
        limits = limits_of(info)
        problem = size_problem(width, height, limits) if limits else None
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("num_inference_steps")
    @classmethod
    def _steps(cls, v: int | None, info: ValidationInfo) -> int | None:
        limits = limits_of(info)
        top = limits.max_steps if limits else None
        least = limits.min_steps if limits else 1
        if v is not None and (v < least or (top is not None and v > top)):
            raise ValueError(f"num_inference_steps must be between {least} and {top}, got {v}")
        return v

    @field_validator("guidance_scale")
    @classmethod
    def _scale(cls, v: float | None, info: ValidationInfo) -> float | None:
        limits = limits_of(info)
        if (v is not None and limits and limits.guidance_style == GuidanceMode.TRUE_CFG
                and not limits.guidance_embeds):
            raise ValueError(f"guidance_scale is not used by {limits.model_name!r} (no guidance embedding); it "
                             "guides with true_cfg_scale on negative_prompt")
        return guidance_scale(v, info)

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: float | None, info: ValidationInfo) -> float | None:
        limits = limits_of(info)
        if v is not None and limits and v > limits.max_timeout_s:
            raise ValueError(f"timeout_s must be at most {limits.max_timeout_s:g} seconds, got {v}")
        return v

    @field_validator("cfg_gate_step")
    @classmethod
    def _cfg_gate_step(cls, v: float | None) -> float | None:
        if v is not None and not 0.0 < v <= 1.0:
            raise ValueError(f"cfg_gate_step must be in (0, 1] (1.0 turns gating off), got {v}")
        return v

    @field_validator("attention_backend_override")
    @classmethod
    def _attention_backend_override(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None:
            one_of("attention_backend_override", v, kernel_names())
        limits = limits_of(info)
        if v is not None and limits and limits.attention_rejections.get(v):
            raise ValueError(f"attention_backend_override {v!r} cannot run on this deployment: "
                             + "; ".join(limits.attention_rejections[v]))
        return v

    @field_validator("cache_dit_params")
    @classmethod
    def _cache_dit_fits_the_model(cls, params: CacheDiTParams | None, info: ValidationInfo):
        """Knobs checked against the model and this request: ``secondary`` only for models with
        two transformers, Fn + Bn within the model's blocks, SCM bins covering the steps. A
        field validator, so its problems are listed with every other field's."""
        limits = limits_of(info)
        if not limits or params is None:
            return params
        steps = None if cls.steps_follow_strength else (info.data.get("num_inference_steps") or limits.default_steps)
        problems = cache_dit_problems(params, limits, steps)  # edits: once strength is known (contract.edits)
        if problems:
            raise ValueError("; ".join(problems))
        return params

    @model_validator(mode="after")
    def _size_encodes(self) -> "GenerationRequest":
        """A size the encoder cannot write failed its whole batch after the denoise (helper-70):
        an image's ``output_format``, a video's WebP thumbnail (no ``output_format``)."""
        problem = encoding_problem(*parse_size(self.size), getattr(self, "output_format", None)) if self.size else None
        if problem:
            raise ValueError(problem)
        return self

    def check_split(self, limits: ServingLimits | None, latent_frames: int, frames_field: str | None = None) -> None:
        """Sequence parallelism splits the latent tokens of a sample evenly across the ranks
        (unless the model pads its sequence to a multiple the ranks divide: any size splits).
        Raises ``ValueError`` starting ``size WxH`` (:func:`split_problem`: the numbers and the
        rule, naming ``frames_field`` too for a video; ``describe_error`` reads the field from it)."""
        if not limits:
            return
        width, height = parse_size(self.size) if self.size else (limits.default_width, limits.default_height)
        problem = split_problem(width, height, limits, latent_frames, frames_field)
        if problem:
            raise ValueError(problem)


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: itself, or inside ``X | None``, ``list[X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


def fields_at(model: type[BaseModel], path: tuple, validated_as: dict | None = None) -> dict | None:
    """The fields of the (nested) model at ``path`` of ``model`` (None: not a model there);
    list indices (``lora.0``) and mapping keys (``loras.mine``) in ``path`` stay on the values'
    model. ``validated_as``: ``{(model name, field name): model}`` for fields kept as plain
    mappings but validated by a model of their own."""
    key_next = False
    for part in path:
        if key_next or isinstance(part, int):
            key_next = False
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        annotation = (validated_as or {}).get((model.__name__, str(part)), field.annotation)
        candidates = _models_in(annotation)
        if not candidates:
            return None
        key_next = any(get_origin(a) is dict for a in (annotation, *get_args(annotation)))
        model = candidates[0]
    return model.model_fields


# Errors our own checks raise: their messages name the allowed values already. Every other
# type is pydantic's own (a value of the wrong type, past a Field bound, a required field left
# out), which says what is wrong but not what is allowed: the field's ALLOWED text is added.
OWN_ERRORS = frozenset({"value_error", "assertion_error", "extra_forbidden"})
# Fields of OpenAI's images API (create and edit: gpt-image and DALL-E models) that no ditserve
# model takes; named as such, not as unknown (helper-63: "unknown field 'quality'"). Image
# requests take ``background`` auto or opaque (ImageGenerationRequest); a video request is told so
OPENAI_ONLY_FIELDS = frozenset({"quality", "background", "moderation", "style", "input_fidelity"})


def allowed_text(model: type[BaseModel], field: str, limits: ServingLimits) -> str | None:
    """What ``field`` of ``model`` takes on this deployment: the ``ALLOWED`` entry of the most
    derived class that has one, filled from ``limits`` (None: no entry)."""
    for cls in model.__mro__:
        text = vars(cls).get("ALLOWED", {}).get(field)
        if text is not None:
            return text(limits) if callable(text) else text.format(limits=limits)
    return None


def named_field(model: type[BaseModel], loc: tuple) -> tuple[type[BaseModel], str | None, tuple]:
    """The innermost field ``loc`` names: ``(its model, its name, loc without the union member
    tags pydantic inserts, such as ``image.list[bytes].0``)``; the name is None for none."""
    owner, name, current, path = model, None, model, []
    for part in loc:
        if isinstance(part, int):
            path.append(part)
        elif current is not None and part in current.model_fields:
            owner, name = current, part
            path.append(part)
            models = _models_in(current.model_fields[part].annotation)
            current = models[0] if models else None
    return owner, name, tuple(path)


def one_per_union(errors: list[dict], model: type[BaseModel]) -> list[dict]:
    """``errors`` with one error per field whose union type's members each failed, the first
    (its input the whole value; helper-61: ``image: [1, 2]`` was described three times, as
    ``image``, ``image.0`` and ``image.1``)."""
    kept, seen = [], set()
    for error in errors:
        loc = tuple(error.get("loc", ()))
        _, _, path = named_field(model, loc)
        if error.get("type") not in OWN_ERRORS and path != loc:  # a union member's error (not an unknown key's)
            while path and isinstance(path[-1], int):
                path = path[:-1]
            if path in seen:
                continue
            seen.add(path)
        kept.append(error)
    return kept


def describe_error(error: dict, model: type[BaseModel], limits: ServingLimits | None = None) -> tuple[str, str]:
    """One pydantic error → ``(top-level field, message naming the field's dotted path)``; with
    ``limits``, pydantic's own errors also name what the field takes (``allowed_text``; helper-59:
    ``{"priority": 1}`` read "priority: Input should be a valid string")."""
    message = error.get("msg", "invalid").removeprefix("Value error, ")
    loc = tuple(error.get("loc", ()))
    if loc and limits is not None and error.get("type") not in OWN_ERRORS:
        owner, name, path = named_field(model, loc)
        allowed = allowed_text(owner, name, limits) if name else None
        if allowed is not None:
            dotted = ".".join(str(p) for p in path)
            if error.get("type") == "missing":
                return str(loc[0]), f"{dotted}: {message}; allowed: {allowed}"
            # a union's members each fail: one message for the field, not one per member type
            message = re.sub(r"a valid dictionary or instance of \w+", "an object", message)  # no class names
            what = f"{shown(error.get('input'))} is not allowed" if path != loc else \
                f"{message.replace('a valid tuple', 'a list')}, got {shown(error.get('input'))}"
            return str(loc[0]), f"{dotted}: {what}; allowed: {allowed}"
    if not loc:  # a model-level check: it names its field first ("seconds: give either ...")
        field = message.split(":")[0].split(" ")[0].split(".")[0]
        return (field if field in model.model_fields or field == "extra_body" else "body"), message
    top, path = str(loc[0]), ".".join(str(p) for p in loc)
    if error.get("type") == "extra_forbidden":
        if len(loc) == 1 and top in OPENAI_ONLY_FIELDS:
            return top, (f"{top}: a field of OpenAI's gpt-image and DALL-E models, which ditserve's models do not "
                         "take; send the request without it")
        if len(loc) == 1:  # keys are echoed cut short, as values are
            return top[:40], f"unknown field {shown(top)}{did_you_mean(top, (*model.model_fields, 'extra_body'))}"
        allowed = fields_at(model, loc[:-1]) or {}
        parent = ".".join(str(p) for p in loc[:-1])
        return top[:40], f"{parent[:80]} has unknown key {shown(str(loc[-1]))}; allowed: {', '.join(allowed)}"
    if message.startswith((path, top)):
        return top, message
    return top, f"{path}: {message}"


def check_shape(body: dict, limits: ServingLimits) -> None:
    """Refuse, cheaply and before any per-field validation, a body no legitimate request has:
    objects nested deeper than ``MAX_BODY_DEPTH``, more values than a request can use (a few
    dozen fields and two lists of at most ``max_steps`` bins), strings longer than
    ``max_prompt_chars``. Bounds the work validation does and the errors it can produce.
    Raises ``InvalidRequestError`` naming the top-level field."""
    max_values = 64 + 4 * limits.max_steps
    max_string = max(limits.max_prompt_chars, MAX_SHORT_TEXT)
    stack, values = [(key, value, 1) for key, value in body.items()], 0
    while stack:
        top, value, depth = stack.pop()
        values += 1
        if values > max_values:
            raise InvalidRequestError(f"request body has more than {max_values} values; no request needs as many",
                                      param="body", code="invalid_value")
        if depth > MAX_BODY_DEPTH:
            raise InvalidRequestError(f"{top}: objects nest more than {MAX_BODY_DEPTH} levels deep", param=str(top),
                                      code="invalid_value")
        if isinstance(value, str) and len(value) > max_string:
            if top in FILE_FIELDS:  # a handle caller's base64 text: not a shorter string (helper-74)
                raise InvalidRequestError(f"{top}: expected file bytes (an upload; through a handle, bytes), got a "
                                          f"string of {len(value)} characters", param=str(top), code="invalid_value")
            raise InvalidRequestError(f"{top}: a string of {len(value)} characters; at most {max_string} are allowed",
                                      param=str(top), code="invalid_value")
        if isinstance(value, dict):
            stack.extend((top, v, depth + 1) for v in value.values())
            values += len(value)  # keys count too
        elif isinstance(value, (list, tuple)):
            stack.extend((top, v, depth + 1) for v in value)


def json_like(value):
    """A handle caller's Python values as JSON brings them: integral numbers other than ``int``
    (numpy's ``int64``, ...; not ``bool``) as ``int``, numpy's ``bool_`` as ``bool``, tuples as
    lists (helper-74: a numpy seed was a 400 'valid integer', a tuple of adapters one of 'valid
    list'; helper-79: ``np.True_`` one of 'valid boolean'; numpy floats already pass as floats).
    Bytes-like values and everything else unchanged; call after :func:`check_shape` (it bounds
    the walk)."""
    if isinstance(value, dict):
        return {key: json_like(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_like(v) for v in value]
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    numpy = sys.modules.get("numpy")  # a numpy value means numpy is imported: never imported here
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    return value


def validate_body(model_class: type[BaseModel], body: Any, limits: ServingLimits):
    """Validate ``body`` (a dict or a request model) as ``model_class`` against ``limits``.

    Raises ``ModelNotFoundError`` (404) if ``model`` names another model, and
    ``InvalidRequestError`` (400) listing every problem (the first ``MAX_ERRORS_LISTED``, then
    how many more), ``param`` the first offending field.
    """
    if isinstance(body, BaseModel):
        body = body.model_dump(exclude_unset=True)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param="body", code="invalid_value")
    odd = [key for key in body if not isinstance(key, str)]  # a handle call's dict may hold any
    if odd:
        raise InvalidRequestError(f"request field names are strings, got {shown(odd[0])}", param="body",
                                  code="invalid_value")
    check_shape(body, limits)
    body = json_like(body)
    model_adapter(body.get("model"), limits)  # 404 before any 400: the model is checked first
    try:
        request = model_class.model_validate(body, context={"limits": limits})
    except ValidationError as exc:
        errors = one_per_union(exc.errors(include_url=False), model_class) + checks_across_fields(
            model_class, body, exc, limits)  # (as many as check_shape lets a body hold)
        described = list(dict.fromkeys(describe_error(e, model_class, limits) for e in errors))
        message = "; ".join(m for _, m in described[:MAX_ERRORS_LISTED])
        if len(described) > MAX_ERRORS_LISTED:
            message += f"; and {len(described) - MAX_ERRORS_LISTED} more problems"
        raise InvalidRequestError(message, param=described[0][0], code="invalid_value") from None
    check_loras(request, model_adapter(request.model, limits), limits)  # also a model given in extra_body
    return request


REQUIRED_STAND_INS = {"prompt": "a", "image": b"a"}  # for checks_across_fields


def checks_across_fields(model_class: type[BaseModel], body: dict, exc: ValidationError,
                         limits: ServingLimits) -> list[dict]:
    """The errors of ``model_class``'s checks across fields (its ``mode="after"`` validators:
    a size the ranks cannot split, ``partial_images`` without ``stream``, ...) that ``exc``
    lacks because pydantic runs them only once every field passed, so a 400 lists every reason,
    not only the fields' own. Only when no field those checks read failed
    (``model_class.CROSS_CHECKED_FIELDS``): the body without the failed fields (top level and in
    ``extra_body``; a failed required field replaced by a stand-in its own check passes, which
    no check across fields reads) is validated again and its model-level errors are listed.
    Had a field they read failed, its default would stand in for the value the caller meant,
    and a check could report a problem the request does not have (a bad ``mask`` turning an
    inpaint into image-to-image)."""
    failed = {str(e["loc"][0]) for e in exc.errors(include_url=False) if e.get("loc")}
    fields = model_class.model_fields
    required = {name for name, field in fields.items() if field.is_required()}
    read = getattr(model_class, "CROSS_CHECKED_FIELDS", frozenset())
    if not failed or failed & read or not (failed & required) <= REQUIRED_STAND_INS.keys():
        return []
    rest = {key: value for key, value in body.items() if key not in failed}
    if isinstance(rest.get("extra_body"), dict):
        rest["extra_body"] = {key: value for key, value in rest["extra_body"].items() if key not in failed}
    rest.update({name: REQUIRED_STAND_INS[name] for name in failed & required})
    try:
        model_class.model_validate(rest, context={"limits": limits})
    except ValidationError as again:
        return [e for e in again.errors(include_url=False) if not e.get("loc")]
    return []


def served_models(limits: ServingLimits) -> str:
    """The model ids a request may name, as text: the base model and one per adapter."""
    return ", ".join(repr(m) for m in [limits.model_name, *(adapter_model_id(limits.model_name, n)
                                                              for n in sorted(limits.loras))])


def model_adapter(model: Any, limits: ServingLimits) -> str | None:
    """The registered adapter ``model`` names (``"<base>:<adapter>"``; None: the base model or
    no ``model``). Raises ``ModelNotFoundError`` (404) for any other value."""
    if model is None or model == limits.model_name:
        return None
    try:
        adapter = split_model(model, limits.model_name) if isinstance(model, str) else None
    except KeyError:
        adapter = None
    if adapter not in limits.loras:
        raise ModelNotFoundError(f"model {shown(model)} is not served here; available: {served_models(limits)}",
                                 param="model", code="model_not_found")
    return adapter


def check_loras(request: GenerationRequest, adapter: str | None, limits: ServingLimits) -> None:
    """Every adapter a validated request names is registered (else ``ModelNotFoundError``,
    404, naming it), and the ``model`` adapter plus ``lora`` stay within ``max_loras`` without
    naming one twice (else ``InvalidRequestError``)."""
    names = [item.name for item in request.lora or ()]
    if adapter is not None and adapter in names:
        raise InvalidRequestError(f"lora names adapter {adapter!r}, which model already selects; name it once",
                                  param="lora", code="invalid_value")
    if adapter is not None and len(names) + 1 > limits.max_loras:
        raise InvalidRequestError(f"model and lora select {len(names) + 1} adapters; at most {limits.max_loras} "
                                  "are allowed (limits.max_loras)", param="lora", code="invalid_value")
    unknown = [n for n in names if n not in limits.loras]
    if unknown:
        registered = ", ".join(map(repr, sorted(limits.loras))) or "none"
        raise ModelNotFoundError(f"LoRA adapter {unknown[0]!r} is not registered on this server; registered: "
                                 f"{registered}", param="lora", code="lora_not_found")
