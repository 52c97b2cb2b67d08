"""The validated application config: the ``args`` of ``build_app`` and of a Serve config file."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from parallel.config import ParallelConfig, paired_sharding_problem, sharding_problems
from parallel.kernels import default_kernel_rejections, kernel_names
from pipeline.cache_dit_params import CacheDiTParams
from pipeline.contract.base import fields_at
from pipeline.contract.limits import ENCODER_MAX_SIDE, MAX_GUIDANCE_SCALE, ServingLimits, parse_size, size_problem
from pipeline.contract.lora import LoraEntry, name_problem, scale_problem
from pipeline.contract.text import did_you_mean, shown
from pipeline.modes import offload_problems
from pipeline.tiny.names import EMBEDDED_DUAL_MODES, EMBEDDED_NAMES, EMBEDDED_SIZE_GRIDS, EMBEDDED_VIDEO_NAMES

# Where the embedded tiny-flux adapters live (pipeline.tiny.lora; a path of null names one).
EMBEDDED_LORA_DIR = Path(__file__).resolve().parent.parent / "pipeline" / "tiny" / "weights" / "loras"


INT_CEILING = 2**31 - 1  # the largest integer a config field takes (Serve's options are int32 on the wire)


def _numeric(annotation) -> bool:
    """Whether a field's annotation is ``int`` or ``float`` (or an optional one)."""
    return annotation in (int, float) or (get_origin(annotation) in (Union, UnionType) and
                                          any(a in (int, float) for a in get_args(annotation))
                                          and bool not in get_args(annotation))


class _Strict(BaseModel):
    """A config section: a key it does not have is refused, and so is a number that is not a
    plain finite one: ``inf`` / ``nan``, a boolean (lax pydantic reads ``true`` as 1), an
    integer above :data:`INT_CEILING` (Serve refused it with an unnamed "Value out of range")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_number(cls, value, info):
        if _numeric(cls.model_fields[info.field_name].annotation):
            if isinstance(value, bool):
                raise ValueError(f"takes a number, not {str(value).lower()}")
            if isinstance(value, int) and abs(value) > INT_CEILING:
                raise ValueError(f"must be at most {INT_CEILING} in magnitude")
        return value


class LoraSettings(_Strict):
    """One registered LoRA adapter: ``path`` to a local LoRA file or directory in a format
    diffusers' ``load_lora_weights`` reads (diffusers/PEFT safetensors, kohya or xlabs FLUX),
    or null for the embedded tiny-flux adapter of the same name (``magenta``, ``outline``);
    ``default_scale``: its scale when a request gives none."""

    path: str | None = Field(default=None, min_length=1)
    default_scale: float = Field(default=1.0, allow_inf_nan=False)


class VaeSettings(_Strict):
    """The VAE decode (diffusers' own switches). ``slicing``: decode one sample at a time
    (``enable_slicing``: memory bounded by one sample, for large n x size; same pixels).
    ``tiling``: decode in overlapping spatial tiles blended at the seams (``enable_tiling``:
    memory bounded by one tile, for large sizes and videos); on a multi-rank replica the tiles of
    an image or video are decoded in parallel across the ranks and blended on rank 0
    (``parallel.vae``: Wan, FLUX.1, FLUX.2 and Z-Image VAEs; Qwen-Image's VAE decodes on rank 0
    alone), the same pixels as one rank's tiled decode."""

    tiling: bool = False
    slicing: bool = False


class ModelConfig(_Strict):
    """Which checkpoint to serve. ``path: null`` with ``name: tiny-flux`` is the embedded model.

    ``loras``: the LoRA adapters requests may name (name -> ``LoraSettings``); checked against
    the model when a replica starts or the registry changes (Serve ``user_config`` of
    DiTReplica and Ingress: ``{"loras": {...}}``). ``max_loaded_loras``: adapters each replica
    keeps loaded (LRU). ``lora_max_rank``: with ``torch_compile``, the rank every hot-swap slot
    is padded to (the highest rank an adapter may have).
    """

    name: str = "tiny-flux"
    path: str | None = None
    family: str | None = None  # detected from model_index.json when omitted
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"  # cpu, cuda or cuda:N; a rank's own GPU: cuda (parallel)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d{1,4})?", v):
            raise ValueError(f"{shown(v)} is not a device ditserve runs on; use cpu, cuda or cuda:N")
        return v

    @model_validator(mode="after")
    def _embedded_or_path(self) -> "ModelConfig":
        if self.path is None and self.name not in EMBEDDED_NAMES:
            raise ValueError(f"name {shown(self.name)} is not an embedded model ({', '.join(EMBEDDED_NAMES)}); "
                             "give the checkpoint's path (a diffusers directory or a hub id) for any other")
        return self

    @field_validator("family")
    @classmethod
    def _family(cls, v: str | None) -> str | None:
        from pipeline.families import REGISTRY  # names only: a family's module loads where it runs

        if v is not None and v not in REGISTRY:
            raise ValueError(f"unknown model family {v!r}; known: {', '.join(sorted(REGISTRY))}")
        return v
    # Execution mode of a second transformer: "boundary" (Wan 2.2 experts, the default when
    # the pipeline has a boundary_ratio) or "paired"; null: what the checkpoint declares.
    dual_transformer: Literal["boundary", "paired"] | None = None
    vae: VaeSettings = Field(default_factory=lambda: VaeSettings())
    # Transformer weights that do not all fit on the device (pipeline.offload): "idle_expert"
    # keeps only the running expert of a boundary-expert model there, "group" is diffusers'
    # group offloading (block by block from host memory).
    offload: Literal["none", "idle_expert", "group"] = "none"
    loras: dict[str, LoraSettings] = Field(default_factory=dict)
    max_loaded_loras: int = Field(default=4, ge=1, le=64)
    lora_max_rank: int = Field(default=64, ge=1, le=1024)

    @field_validator("loras")
    @classmethod
    def _loras(cls, v: dict[str, LoraSettings]) -> dict[str, LoraSettings]:
        return check_lora_registry(v)

    def known_dual_mode(self) -> str | None:
        """How the model runs a second transformer (``pipeline.modes.DualMode``'s values) where the
        config alone tells: ``dual_transformer``, else an embedded model's own; None for a
        checkpoint's (read where the replica loads it)."""
        if self.dual_transformer is not None:
            return self.dual_transformer
        return EMBEDDED_DUAL_MODES.get(self.name, "single") if self.path is None else None

    def known_video(self) -> bool | None:
        """Whether the model makes videos, where the config alone tells (an embedded model); None
        for a checkpoint's (read where the replica loads it)."""
        return self.name in EMBEDDED_VIDEO_NAMES if self.path is None else None

    def known_size_grid(self) -> tuple[int, int, float] | None:
        """``(spatial_factor, max_side, max_aspect_ratio)`` of the model's output sizes where the
        config alone tells (an embedded model: ``pipeline.tiny.names.EMBEDDED_SIZE_GRIDS``); None
        for a checkpoint's (read where the replica loads it)."""
        return EMBEDDED_SIZE_GRIDS[self.name] if self.path is None else None

    def lora_registry(self) -> dict[str, LoraEntry]:
        """Adapter name -> ``LoraEntry`` (paths resolved; what requests are resolved against)."""
        return lora_registry(self.loras)


def check_lora_registry(loras: dict[str, LoraSettings]) -> dict[str, LoraSettings]:
    """Names usable in requests, finite default scales in range, a path (or an embedded
    adapter). Raises ``ValueError`` naming ``model.loras.<name>``."""
    problems = []
    for name, settings in loras.items():
        problem = name_problem(f"model.loras key {name!r}", name) or scale_problem(
            f"model.loras.{name}.default_scale", settings.default_scale)
        if problem:
            problems.append(problem)
        elif settings.path is None and not (EMBEDDED_LORA_DIR / name).is_dir():
            embedded = sorted(p.name for p in EMBEDDED_LORA_DIR.iterdir()) if EMBEDDED_LORA_DIR.is_dir() else []
            problems.append(f"model.loras.{name}.path is required (embedded adapters: {', '.join(embedded) or 'none'})")
    if problems:
        raise ValueError("; ".join(problems))
    return loras


def lora_registry(loras: dict) -> dict[str, LoraEntry]:
    """``model.loras`` (settings or plain dicts, as in a ``user_config``) as name -> ``LoraEntry``
    with resolved paths, after :func:`check_lora_registry`. Raises ``ValueError`` (pydantic's
    for a malformed entry) naming the adapter."""
    settings = check_lora_registry({name: LoraSettings.model_validate(v) if isinstance(v, dict) else v
                                    for name, v in loras.items()})
    return {name: LoraEntry(s.path if s.path is not None else str(EMBEDDED_LORA_DIR / name), s.default_scale)
            for name, s in settings.items()}


class LimitsConfig(_Strict):
    """Request defaults and limits (pixels, steps, images per request, prompt characters).

    ``max_timeout_s``: the longest ``timeout_s`` a request may give (seconds).
    ``max_body_bytes``: the largest request body (uploads included; 413 beyond it, before
    parsing); ``max_json_body_bytes``: the largest JSON body (no JSON request carries uploads).
    """

    default_size: str = "64x64"
    default_steps: int = Field(default=16, ge=1)
    default_guidance_scale: float = Field(default=3.5, ge=0, le=MAX_GUIDANCE_SCALE)  # a request's bound
    max_n: int = Field(default=4, ge=1, le=1024)  # batching.max_batch_size's bound: n rows run in one batch
    max_pixels: int = Field(default=256 * 256, ge=1)
    max_steps: int = Field(default=100, ge=1)
    max_prompt_chars: int = Field(default=2000, ge=1)
    # Video models only: frames when a request gives neither seconds nor num_frames, the MP4
    # frame rate when it gives no fps (frames per second), and the most frames a video may have.
    default_num_frames: int = Field(default=9, ge=1)
    default_fps: int = Field(default=8, ge=1, le=120)
    max_frames: int = Field(default=33, ge=1)
    max_timeout_s: float = Field(default=3600.0, gt=0, le=7 * 24 * 3600)
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    max_json_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    max_loras: int = Field(default=4, ge=1, le=16)  # LoRA adapters one request may name
    # Image inputs (edits, image-to-video): image-to-image's strength when a request gives none
    # (FluxImg2ImgPipeline's default), and the most pixels an uploaded image may declare
    # (None: 16 x max_pixels, at most 4096 x 4096, at least max_pixels; pipeline.contract.limits.
    # default_max_input_pixels); larger uploads are refused before they are decoded (image bombs).
    default_strength: float = Field(default=0.6, gt=0, le=1)
    max_input_pixels: int | None = Field(default=None, ge=1)
    # The priority of a request that gives none, per route (deployments.scheduling).
    default_image_priority: Literal["interactive", "batch"] = "interactive"
    default_video_priority: Literal["interactive", "batch"] = "interactive"

    @field_validator("default_size")
    @classmethod
    def _size(cls, v: str) -> str:
        parse_size(v)
        return v

    @model_validator(mode="after")
    def _defaults_within_limits(self):
        """A default past its own limit ran for every request that left the field out (a request
        giving the same value is a 400). Raises ``ValueError`` naming both fields. (Frames and
        sizes' multiples depend on the model: a video model checks ``default_num_frames``
        against ``max_frames`` at startup, see ``deployments.replica.check_defaults``.)"""
        width, height = parse_size(self.default_size)
        problems = [f"default_steps {self.default_steps} > max_steps {self.max_steps}"
                    if self.default_steps > self.max_steps else None,
                    f"default_size {self.default_size} is {width * height} pixels > max_pixels {self.max_pixels}"
                    if width * height > self.max_pixels else None,
                    f"default_size {self.default_size} has a side past {ENCODER_MAX_SIDE['webp']} pixels, which "
                    "output_format webp and a video's thumbnail cannot take"
                    if max(width, height) > ENCODER_MAX_SIDE["webp"] else None]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError(f"{'; '.join(problems)}: a default must be a value a request may give")
        return self


class BatchingConfig(_Strict):
    """Router knobs.

    ``max_batch_size``: images per batch (a request counts ``n``). ``max_batch_cost``:
    optional cap on pixels × frames × n per batch. ``max_wait_ms``: how long the oldest
    request of a queue may wait for company. ``max_queued_requests``: beyond it, 429.
    ``max_queued_batch_requests``: requests of ``priority: batch`` get 429 beyond this many
    queued (of ``max_queued_requests``), so a batch backlog leaves interactive work room
    (None: three quarters of ``max_queued_requests``, at least 1; :func:`queued_batch_limit`).
    ``affinity``: prefer replicas already in the batch's state (off: FIFO over queues and
    Serve's default power-of-two-choices router). ``affinity_switch_cost_ms``: a state
    change priced in waiting: a free replica leaves its own state's queue for another only
    when that queue's oldest request waited longer by this much, and a queue whose state a
    busy replica holds waits for it this long, if a free replica has no queued work of its
    own (``deployments.scheduling``, rule 3).
    ``max_affinity_wait_ms``: the hard bound: a queue whose oldest request waited this long
    goes first, to any free replica.
    ``routing_stats_period_s``: how often replicas report their state to the router.
    ``max_batch_priority_wait_ms``: requests of ``priority: batch`` are served after
    interactive ones, until they have waited this long (their starvation bound).
    """

    max_batch_size: int = Field(default=8, ge=1, le=1024)
    max_batch_cost: float | None = Field(default=None, gt=0)
    max_wait_ms: float = Field(default=10.0, ge=0, le=600_000)
    max_queued_requests: int = Field(default=256, ge=1, le=1_000_000)
    max_queued_batch_requests: int | None = Field(default=None, ge=1)
    affinity: bool = True
    affinity_switch_cost_ms: float = Field(default=250.0, ge=0, le=600_000)
    max_affinity_wait_ms: float = Field(default=2000.0, ge=0, le=600_000)
    routing_stats_period_s: float = Field(default=1.0, gt=0, le=3600)
    max_batch_priority_wait_ms: float = Field(default=30_000.0, ge=0, le=86_400_000)

    @model_validator(mode="after")
    def _batch_share(self):
        if self.max_queued_batch_requests is not None and self.max_queued_batch_requests > self.max_queued_requests:
            raise ValueError(f"max_queued_batch_requests ({self.max_queued_batch_requests}) must be <= "
                             f"max_queued_requests ({self.max_queued_requests})")
        return self


class VideoJobsConfig(_Strict):
    """Retention of finished video jobs in the Router: each is kept ``ttl_s`` seconds after it
    completes or fails and at most ``max_finished`` are kept (the oldest go first); then its
    id answers 404. The ``Idempotency-Key`` of a deleted job is refused ``ttl_s`` seconds, for
    the last ``max_deleted_keys`` keyed deletions."""

    ttl_s: float = Field(default=3600.0, gt=0, le=30 * 24 * 3600)
    max_finished: int = Field(default=100, ge=1, le=1_000_000)
    # Keys of deleted jobs kept (ttl_s each) to refuse a create still on its way: its own bound,
    # a few hundred bytes each (it was max_finished: 100 keyed deletions freed the oldest key)
    max_deleted_keys: int = Field(default=10_000, ge=0, le=1_000_000)
    # Preview frames a running job decodes at evenly spaced steps (the first frame of the current
    # prediction; GET /v1/videos/{id}/content?variant=thumbnail answers the latest); 0: none.
    previews: int = Field(default=2, ge=0, le=3)


class AccelerationConfig(_Strict):
    """Server defaults of the per-request acceleration fields, and torch.compile.

    Each may be overridden by an environment variable of the process that builds the app:
    ``DITSERVE_ENABLE_CACHE_DIT`` (true/false), ``DITSERVE_CACHE_DIT_PARAMS`` (JSON object),
    ``DITSERVE_CFG_GATE_STEP``, ``DITSERVE_ATTENTION_BACKEND``, ``DITSERVE_TORCH_COMPILE``.
    ``warmup``: run one batch of the default signature when a replica starts (always done
    when ``torch_compile`` is on, so the compiled path is the one requests take).
    """

    enable_cache_dit: bool = False
    cache_dit_params: dict[str, Any] | None = None
    cfg_gate_step: float = Field(default=1.0, gt=0, le=1)
    attention_backend: str | None = None
    torch_compile: bool = False
    compile_backend: str = "inductor"
    warmup: bool = False

    @field_validator("cache_dit_params")
    @classmethod
    def _cache(cls, v):
        if v is not None:
            CacheDiTParams.model_validate(v)  # the same model (and messages) as a request's override
        return v

    @field_validator("attention_backend")
    @classmethod
    def _attn(cls, v):
        if v is not None and v not in kernel_names():
            raise ValueError(f"attention_backend must be one of {', '.join(kernel_names())}, got {v!r}")
        return v


def _env_flag(value: str) -> bool:
    """A true/false variable's value (1/0, true/false, yes/no, on/off; any case). Raises
    ``ValueError`` for any other (``maybe`` was read as false)."""
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false (1/0, true/false, yes/no, on/off)")


ENV_OVERRIDES = {
    "DITSERVE_ENABLE_CACHE_DIT": ("enable_cache_dit", _env_flag),
    "DITSERVE_CACHE_DIT_PARAMS": ("cache_dit_params", json.loads),
    "DITSERVE_CFG_GATE_STEP": ("cfg_gate_step", float),
    "DITSERVE_ATTENTION_BACKEND": ("attention_backend", lambda v: v or None),
    "DITSERVE_TORCH_COMPILE": ("torch_compile", _env_flag),
}


def with_env_overrides(args: dict, environ=os.environ) -> dict:
    """``args`` with the acceleration defaults named by ``DITSERVE_*`` variables replaced. Raises
    ``ValueError`` naming the variable whose value does not parse."""
    acceleration = dict(args.get("acceleration") or {})
    for var, (key, parse) in ENV_OVERRIDES.items():
        if var in environ:
            try:
                acceleration[key] = parse(environ[var])
            except ValueError as exc:
                raise ValueError(f"{var}={environ[var]!r}: {exc}") from None
    return {**args, "acceleration": acceleration} if acceleration else dict(args)


def app_config(args: dict, environ=os.environ) -> "AppConfig":
    """``AppConfig`` of ``args`` with the ``DITSERVE_*`` overrides (:func:`with_env_overrides`).

    Raises pydantic's ``ValidationError`` for bad ``args`` when no override is set. With one
    set, a refusal is a ``ValueError`` whose errors name the variable where its value is the
    one refused (``DITSERVE_CACHE_DIT_PARAMS='[1]'`` was "args.acceleration.cache_dit_params:
    Input should be a valid dictionary", a field the config file may not even give), ``args.``
    and the field for the file's own, and the variables set where a check across fields
    refuses what the file alone passes (``DITSERVE_ATTENTION_BACKEND=fa`` on a CPU model)."""
    used = {var: key for var, (key, _) in ENV_OVERRIDES.items() if var in environ}
    try:
        return AppConfig.model_validate(with_env_overrides(args, environ))
    except ValidationError as exc:
        if not used:
            raise
        said = []
        for error in exc.errors():
            loc = tuple(str(part) for part in error.get("loc", ()))
            var = next((v for v, key in used.items() if loc[:2] == ("acceleration", key)), None)
            if var is not None:
                said.append(f"{var}={environ[var]!r} (the acceleration.{used[var]} default): "
                            f"{'.'.join(loc[1:])}: {error_message(error, exc.title)}")
            else:
                said.append(f"{'.'.join(('args', *loc))}: {error_message(error, exc.title)}")
        try:
            AppConfig.model_validate(args)
            alone = True
        except ValidationError:
            alone = False
        if alone and len(said) != sum(1 for line in said if line.startswith("DITSERVE_")):
            setting = ", ".join(f"{var}={environ[var]!r}" for var in used)
            said.insert(0, f"with {setting} set in the environment (the file alone passes)")
        raise ValueError("; ".join(said)) from None


def look_back_problem(look_back_period_s: float, metrics_interval_s: float) -> str | None:
    """Why an autoscaling ``look_back_period_s`` (s) cannot average ``metrics_interval_s``' (s)
    reports, or ``None``: it must be longer than one interval (Ray Serve's ``AutoscalingConfig``
    warns today that it will refuse this; its FutureWarning reached ``--check``'s output)."""
    if look_back_period_s <= metrics_interval_s:
        return (f"look_back_period_s ({look_back_period_s}) must be greater than metrics_interval_s "
                f"({metrics_interval_s}): the queue is averaged over more than one metrics report")
    return None


# seconds between a DiTReplica's metric reports at least: each asks the Router for its queue
# (1e-9 had replicas asking without a pause; helper-64)
MIN_METRICS_INTERVAL_S = 0.1


class AutoscalingSettings(_Strict):
    """Autoscaling of DiTReplica on the Router's queue depth (``deployments.autoscaling``).

    ``target_queued_per_replica``: images waiting in the Router per replica that Serve aims
    for (``null``: the batching ``max_batch_size``, one full batch waiting per replica). The
    other fields are Ray Serve's ``AutoscalingConfig`` fields with Serve's defaults:
    ``min_replicas`` (at least 1: replicas report the queue), ``max_replicas``,
    ``initial_replicas``, ``upscale_delay_s`` / ``downscale_delay_s`` (seconds a decision must
    hold before Serve acts), ``upscaling_factor`` / ``downscaling_factor`` (the share of a
    change Serve makes at once; null: all of it), ``look_back_period_s`` (seconds the queue is
    averaged over), ``aggregation_function`` (how: ``mean``, ``max`` or ``min``) and
    ``metrics_interval_s`` (seconds between a replica's metric reports to the controller).
    Serve's wrapper of a custom policy applies all of them
    (``ray.serve.autoscaling_policy._apply_autoscaling_config``). Not taken: Serve's
    ``target_ongoing_requests`` (the policy scales on ``target_queued_per_replica``), its
    ``policy`` (this one), ``downscale_to_zero_delay_s`` (``min_replicas`` is at least 1) and its
    deprecated smoothing factors.
    """

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=1, ge=1)
    initial_replicas: int | None = Field(default=None, ge=1)
    target_queued_per_replica: float | None = Field(default=None, gt=0)
    upscale_delay_s: float = Field(default=30.0, ge=0)
    downscale_delay_s: float = Field(default=600.0, ge=0)
    look_back_period_s: float = Field(default=30.0, gt=0)
    metrics_interval_s: float = Field(default=10.0, ge=MIN_METRICS_INTERVAL_S)
    upscaling_factor: float | None = Field(default=None, gt=0)  # Serve's bounds (max_replicas bounds the result)
    downscaling_factor: float | None = Field(default=None, gt=0)
    aggregation_function: Literal["mean", "max", "min"] = "mean"

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas ({self.initial_replicas}) must lie in "
                             f"[min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]")
        problem = look_back_problem(self.look_back_period_s, self.metrics_interval_s)
        if problem:
            raise ValueError(problem)
        return self


class ReplicaConfig(_Strict):
    """The DiTReplica deployment's options (Ray Serve's names).

    ``num_replicas``: a fixed replica count; ``autoscaling`` (``AutoscalingSettings``) makes
    Serve scale between ``min_replicas`` and ``max_replicas`` on the Router's queue depth
    instead (give one or the other). ``rank_resources``: one placement-group bundle per rank
    when ``world_size > 1`` (``{"CPU": 1}`` on CPU, ``{"GPU": 1, "CPU": 8}`` on GPU); rank 0
    is the replica actor in bundle 0, ranks 1..N-1 are actors in the other bundles
    (``STRICT_PACK``). ``graceful_shutdown_timeout_s``: how long a running batch may take to
    finish when a replica stops (seconds; Serve's option). The Router and the Ingress stop 5 and
    10 seconds later, so the Ingress answers the requests still queued (503).
    ``graceful_shutdown_wait_loop_s``: Serve's option, for all three deployments: a stopping
    replica waits this long for requests sent to it just before to arrive, then checks for
    ongoing ones this often until none is left (seconds; Serve's default, 2 s, is the floor of an
    idle replica's stop: a redeploy or a scale-down takes that much longer). A batch sent to a
    replica that has already stopped is requeued by the Router (``MAX_REQUEUES``).
    ``health_check_period_s`` / ``health_check_timeout_s``: Serve's health checks of a replica
    (seconds); a replica that breaks exits, and Serve replaces it at the next check.
    ``max_constructor_retry_count``: Serve's option: failed replica starts (a checkpoint that
    does not load, a layout the model cannot split) before Serve gives up on the deployment
    (``DEPLOY_FAILED``; the Router then answers 503 at once); Serve also gives up after 3 per
    replica; ``None``: Serve's default (20). 1 fails a broken deploy on its first start instead
    of after three (each loading the weights again).
    ``cpu_nice``: the replica's and its ranks' CPU priority (Unix nice, 0..19) below the
    serving path's (proxy, Ingress, Router), so refusals, status polls and health checks are
    answered at once while a batch computes on the same cores; 0 keeps the same priority.
    ``routing_nice``: the Ingress's and the Router's CPU priority (nice, 0..19) below Serve's
    proxy, so the proxy's refusals (``deployments.proxy.AdmissionGate``) are not delayed while
    they work through a burst's accepted requests (``bench/overload.py``: refusal p99 190-250 ms
    at 0, 65-115 ms at 10 on 2 cores); it matters only where the serving path and compute share
    CPU cores. Both are added to the nice Ray starts its workers at (15 by default; Linux caps
    nice at 19), so with the defaults routing and compute end at the same level, 19.
    """

    num_replicas: int = Field(default=1, ge=1)
    autoscaling: AutoscalingSettings | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    torch_threads: int | None = Field(default=None, ge=1, le=1024)
    rank_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1})
    graceful_shutdown_timeout_s: float = Field(default=20.0, gt=0)
    graceful_shutdown_wait_loop_s: float = Field(default=2.0, gt=0, le=60)
    health_check_period_s: float = Field(default=2.0, gt=0)
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    max_constructor_retry_count: int | None = Field(default=None, ge=1)
    cpu_nice: int = Field(default=10, ge=0, le=19)
    routing_nice: int = Field(default=10, ge=0, le=19)

    @model_validator(mode="after")
    def _replicas(self):
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("give either num_replicas or autoscaling, not both")
        return self

    @property
    def most_replicas(self) -> int:
        """Replicas at most: ``num_replicas``, or autoscaling's ``max_replicas``."""
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas

    @property
    def initial_replicas(self) -> int:
        """Replicas at start: ``num_replicas``, or the autoscaling initial/min count."""
        if self.autoscaling is None:
            return self.num_replicas
        return self.autoscaling.initial_replicas or self.autoscaling.min_replicas


def error_message(error: dict, title: str | None = None) -> str:
    """One pydantic error's message, less the "Value error, " pydantic puts before a
    validator's ``ValueError``. A key a section does not have ("Extra inputs are not
    permitted") is said with the section's fields and the nearest one, when ``title`` (the
    ``ValidationError``'s: the validated model's class name) names a config model here."""
    loc = tuple(error.get("loc", ()))
    if error.get("type") == "extra_forbidden" and loc:
        fields = _section_fields(title, loc[:-1])
        if fields is not None:
            return f"no such field{did_you_mean(loc[-1], fields)}; the fields there: {', '.join(fields)}"
    return str(error.get("msg", "invalid")).removeprefix("Value error, ") + _yaml_number_hint(error)


# pydantic's error types for a number field given something else
_NUMBER_ERRORS = {"int_parsing", "int_type", "float_parsing", "float_type", "int_from_float", "finite_number"}
# a number written with an exponent (YAML 1.1 reads some of these forms as text)
_EXPONENT = re.compile(r"[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+")


def _yaml_number_hint(error: dict) -> str:
    """For a number field given text that is a number (``1e5``): the YAML 1.1 rule that makes it
    text and how to write it (an integer plainly, else ``1.0e+300``); "" for any other error.
    PyYAML, which Serve and ``ditserve serve`` read configs with, takes an exponent only after a
    dot and with a sign (YAML 1.1's float pattern, https://yaml.org/type/float.html): ``1e5`` is
    the string ``"1e5"``."""
    value = error.get("input")
    if error.get("type") not in _NUMBER_ERRORS or not isinstance(value, str) or not _EXPONENT.fullmatch(value):
        return ""
    import yaml

    number = float(value)
    if not isinstance(yaml.safe_load(value), str) or not math.isfinite(number) or (
            str(error.get("type")).startswith("int") and not number.is_integer()):
        return ""  # quoted in the file (YAML reads the form as a number), or no form of it would do
    if number.is_integer() and abs(number) < 1e18:
        plain = str(int(number))
    else:
        mantissa, exponent = f"{number:.15e}".split("e")
        mantissa = mantissa.rstrip("0") + ("0" if mantissa.rstrip("0").endswith(".") else "")
        plain = f"{mantissa}e{int(exponent):+d}"
    return (f" (got the text {value!r}: YAML 1.1 reads an exponent as a number only after a dot and with a sign; "
            f"write {plain})")


def _section_fields(title: str | None, loc: tuple) -> list[str] | None:
    """The field names of the config section (a pydantic model: ``cache_dit_params`` too) at
    ``loc`` of the :class:`_Strict` model named ``title``, or None (``fields_at``)."""
    model = next((m for m in _strict_models(_Strict) if m.__name__ == title), None)
    fields = fields_at(model, loc, VALIDATED_AS) if model is not None else None
    return list(fields) if fields is not None else None


# Config fields kept as plain mappings but validated by a model of their own: (section, field) -> model
VALIDATED_AS = {("AccelerationConfig", "cache_dit_params"): CacheDiTParams}


def _strict_models(base: type) -> list[type]:
    return [sub for cls in base.__subclasses__() for sub in (cls, *_strict_models(cls))]


def validation_line(exc: ValidationError, where: str = "") -> str:
    """A pydantic ``ValidationError`` as one line: each error's field (dotted, after ``where``)
    and pydantic's message (less its "Value error, "), ``; ``-separated (its ``str`` runs to
    many lines and starts with a count: "1 validation error for AppConfig")."""
    said = []
    for error in exc.errors():
        field = ".".join(str(part) for part in (where, *error.get("loc", ())) if part != "")
        said.append(f"{field or 'config'}: {error_message(error, exc.title)}")
    return "; ".join(said) or str(exc)


def admission_limit_of(max_queued_requests: int, max_batch_size: int, replicas: int) -> int:
    """Requests an app holds at once: ``max_queued_requests`` waiting plus a full batch
    (``max_batch_size`` images) on each of ``replicas``."""
    return max_queued_requests + max_batch_size * replicas


def queued_batch_limit(max_queued_requests: int, max_queued_batch_requests: int | None) -> int:
    """Queued requests beyond which a ``priority: batch`` request is refused (429): the
    configured ``max_queued_batch_requests``, else three quarters of ``max_queued_requests``
    (at least 1), so a backlog of offline work leaves interactive requests a quarter of the
    queue (load shedding lowest priority first)."""
    if max_queued_batch_requests is not None:
        return min(max_queued_batch_requests, max_queued_requests)
    return max(1, max_queued_requests * 3 // 4)


MAX_WORLD_SIZE = 1024  # ranks of one replica: 128 nodes of 8 GPUs (the largest layout here uses 8)


class ParallelSettings(_Strict):
    """Parallelism of one replica: ``world_size = cfg_degree × ulysses_degree × ring_degree``
    ranks, a (cfg × ring × ulysses) device mesh (``parallel.config.ParallelConfig``).

    ``cfg_degree`` 2: a guided step's conditional and guiding forwards run on two groups of
    ranks, unguided batches split their images across them (``parallel.cfg``).
    ``shard_weights``: the transformers' weights are sharded across every rank with PyTorch
    FSDP2 (``parallel.fsdp``): about 1/world_size of them per rank, gathered block by block.
    ``rendezvous_timeout_s``: how long the ranks wait for each other to join the process group
    (seconds), counted once every rank has loaded its model.
    """

    ulysses_degree: int = Field(default=1, ge=1)
    ring_degree: int = Field(default=1, ge=1)
    cfg_degree: Literal[1, 2] = 1
    shard_weights: bool = False
    rendezvous_timeout_s: float = Field(default=600.0, gt=0)

    @property
    def world_size(self) -> int:
        return self.layout().world_size

    def layout(self) -> ParallelConfig:
        """The replica's rank layout (``parallel.config.ParallelConfig``)."""
        return ParallelConfig.of(self.model_dump())

    @model_validator(mode="after")
    def _layout(self):
        """Layouts no model could run (the model's own limits, e.g. heads, are checked where
        the replica starts). Raises ``ValueError`` naming the fields."""
        ranks = self.cfg_degree * self.ulysses_degree * self.ring_degree
        if ranks > MAX_WORLD_SIZE:  # each rank is a placement group bundle, listed before Serve sees it
            raise ValueError(f"world_size = cfg_degree x ulysses_degree x ring_degree = {ranks}: at most "
                             f"{MAX_WORLD_SIZE} ranks (GPUs) per replica")
        problems = [p for p in self.layout().startup_problems(num_heads=self.ulysses_degree)]
        if problems:
            raise ValueError("; ".join(problems))
        return self


class AuthConfig(_Strict):
    """Optional API keys for the HTTP API (OpenAI's ``Authorization: Bearer <key>``).

    ``api_keys_env``: an environment variable of the Ingress process holding the keys (one per
    line or comma-separated; on KubeRay, filled from a Kubernetes Secret). ``api_keys_file``: a
    file of keys. Neither: no authentication. ``/health`` stays open; handle calls from Ray
    jobs of the same cluster are not checked (the cluster is the trust boundary).
    ``batch_api_keys_env`` / ``batch_api_keys_file``: more keys (same formats), whose requests
    default to ``priority: batch`` (offline jobs' keys); they turn authentication on too.
    """

    api_keys_env: str | None = None
    api_keys_file: str | None = None
    batch_api_keys_env: str | None = None
    batch_api_keys_file: str | None = None

    @field_validator("api_keys_env", "batch_api_keys_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        """An environment variable's name (helper-64: ``""`` passed, and the Ingress never started)."""
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"an environment variable's name (letters, digits and _, not starting with a digit), "
                             f"got {v!r}")
        return v

    @field_validator("api_keys_file", "batch_api_keys_file")
    @classmethod
    def _file_name(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("a file's path, got an empty one")
        return v


class AppConfig(_Strict):
    """Everything ``build_app`` needs; unknown keys are errors so a typo never passes."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    acceleration: AccelerationConfig = Field(default_factory=AccelerationConfig)
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    parallel: ParallelSettings = Field(default_factory=ParallelSettings)
    videos: VideoJobsConfig = Field(default_factory=VideoJobsConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)

    @model_validator(mode="after")
    def _weights(self):
        """Memory options that cannot work together, and with the model where the config tells
        how it runs two transformers (:meth:`ModelConfig.known_dual_mode`; a checkpoint's is
        checked where the replica starts: helper-67 found ``idle_expert`` on an embedded model
        without experts refused only there). Raises ``ValueError`` naming the fields."""
        dual_mode = self.model.known_dual_mode()
        problems = offload_problems(self.model.offload, boundary_experts=dual_mode in (None, "boundary"),
                                    torch_compile=self.acceleration.torch_compile)
        paired = paired_sharding_problem(shard_weights=self.parallel.shard_weights,
                                         cfg_degree=self.parallel.cfg_degree, dual_mode=dual_mode)
        problems += [paired] if paired else []
        problems += [p for p in sharding_problems(shard_weights=self.parallel.shard_weights,
                                                  world_size=self.parallel.world_size,
                                                  torch_compile=self.acceleration.torch_compile,
                                                  loras=bool(self.model.loras), offload=self.model.offload)
                     if "world_size" not in p]  # a single-rank layout is refused with the parallel section
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _batches_fit(self):
        """The batching knobs must run what the limits admit (:func:`batch_fit_problems`), as far
        as the config tells the model: ``max_n`` for an embedded image model, the default
        request's frames for an embedded video model; a checkpoint's (and a reference-editing
        model's input image) are checked where the replica loads it
        (``deployments.replica.check_defaults``). Raises ``ValueError``."""
        problems = batch_fit_problems(self.batching.model_dump(), self.limits.model_dump(), self.model.known_video())
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _default_size_on_grid(self):
        """``limits.default_size`` must be a size the model makes, as far as the config tells its
        grid (:meth:`ModelConfig.known_size_grid`: an embedded model; a checkpoint's is checked
        where the replica loads it, ``deployments.replica.check_defaults``). helper-76: ``60x64``
        on tiny-flux passed ``--check`` and failed each replica's start. Raises ``ValueError``."""
        grid = self.model.known_size_grid()
        if grid is None:
            return self
        width, height = parse_size(self.limits.default_size)
        spatial_factor, max_side, max_aspect_ratio = grid
        problem = size_problem(width, height, ServingLimits(
            model_name=self.model.name, spatial_factor=spatial_factor, default_width=width, default_height=height,
            default_steps=self.limits.default_steps, default_guidance_scale=0.0, max_pixels=self.limits.max_pixels,
            max_side=max_side, max_aspect_ratio=max_aspect_ratio))
        if problem:
            raise ValueError(default_refused("default_size", self.model.name, problem))
        return self

    @model_validator(mode="after")
    def _default_knobs(self):
        problem = default_knobs_problem(self.acceleration, self.limits.default_steps)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _default_kernel(self):
        """The default kernel must run on the configured device, dtype and parallel layout, by
        the rules a request's override is checked with; whether its package is installed is
        checked where the replica starts (this file may be read on a node without GPU packages)."""
        problem = default_kernel_problem(self.acceleration.attention_backend, self.model.device, self.model.dtype,
                                         self.parallel.ring_degree)
        if problem:
            raise ValueError(problem)
        return self


def default_refused(field: str, model_name: str, problem: str) -> str:
    """The message for ``limits.<field>``'s default that no request to ``model_name`` may give
    (``problem``: the request check's own words)."""
    return f"limits.{field}: the default is a value no request may give to model {model_name!r}: {problem}"


def default_request_cost(limits: dict, video: bool, reference: bool = False) -> float:
    """``batching.max_batch_cost``'s units (pixels × frames × n, input images included, as
    ``deployments.router.request_cost`` counts them) of the request that gives a prompt alone:
    ``limits.default_size``'s pixels × ``limits.default_num_frames`` for a ``video`` model (1 frame
    for an image model) × 2 for a model that only edits by ``reference`` (its smallest request
    gives one image of the default size, whose tokens join the sequence). ``limits``:
    ``LimitsConfig.model_dump()``."""
    width, height = parse_size(limits["default_size"])
    return float(width * height * (limits["default_num_frames"] if video else 1) * (2 if reference else 1))


def batch_fit_problems(batching: dict, limits: dict, video: bool | None, reference: bool = False,
                       n: bool = True) -> list[str]:
    """Why requests the server admits could never run under the batching knobs ``batching``
    (``BatchingConfig.model_dump()``; ``limits``: ``LimitsConfig.model_dump()``): the request
    giving a prompt alone costing more than ``max_batch_cost`` (:func:`default_request_cost` with
    ``video`` and ``reference``: every request leaving size out answered 400), and with ``n`` an
    image model's ``max_n`` (``video`` False; a video model makes one video per request, and
    None, not known, checks no n) past ``max_batch_size`` (a request's n images run in one batch:
    the Router answers a larger n 400). Empty when they fit. helper-76: both passed ``--check``
    and the deploy, and the server answered every request 400."""
    problems = []
    if n and video is False and limits["max_n"] > batching["max_batch_size"]:
        problems.append(f"limits.max_n {limits['max_n']} > batching.max_batch_size {batching['max_batch_size']}: "
                        "a request's n images run in one batch, so a request with n past it would be refused; "
                        "lower max_n or raise max_batch_size")
    cost, default_cost = batching.get("max_batch_cost"), default_request_cost(limits, bool(video), reference)
    if cost is not None and cost < default_cost:
        problems.append(f"batching.max_batch_cost {cost:g} < {default_cost:g}, the pixels x frames x n of a request "
                        "giving a prompt alone (limits.default_size, and default_num_frames for a video model): "
                        "every request leaving size out would be refused; raise max_batch_cost or lower the defaults")
    return problems


def batching_update(args_batching: dict, knobs: dict | None, limits: dict | None = None, video: bool | None = None,
                    reference: bool = False) -> "BatchingConfig":
    """The Router's batching knobs after a ``user_config`` update ``knobs``: a knob it leaves
    out keeps ``args``' value (``args_batching``, ``BatchingConfig.model_dump()``). Raises
    pydantic's ``ValidationError`` naming the knob, and ``ValueError`` for a knob only the
    application's start reads: ``routing_stats_period_s`` (DiTReplica's request router's, built
    once) and ``affinity: true`` where ``args`` turned it off (the request router chosen then
    tells the Router no replica's state). helper-64: both showed in ``/v1/stats`` as in force.
    With ``limits``, also ``ValueError`` for a ``max_batch_cost`` under which a request giving a
    prompt alone could not run (:func:`batch_fit_problems` with ``video`` and ``reference``); a
    ``max_batch_size`` lowered under ``limits.max_n`` stays a live option (a request with a larger
    ``n`` is answered 400 naming it), where ``args`` giving both is refused (``AppConfig``)."""
    new = BatchingConfig.model_validate({**args_batching, **(knobs or {})})  # as read: "true" is True (helper-65)
    if new.routing_stats_period_s != args_batching["routing_stats_period_s"]:
        raise ValueError(f"routing_stats_period_s: DiTReplica's request router reads it at the application's start "
                         f"({args_batching['routing_stats_period_s']:g} s): change args.batching, not a user_config")
    if new.affinity and not args_batching["affinity"]:
        raise ValueError("affinity: args.batching.affinity is false, so DiTReplica's request router reports no "
                         "replica's state, which affinity needs: change args.batching, not a user_config")
    problems = batch_fit_problems(new.model_dump(), limits, video, reference, n=False) if limits is not None else []
    if problems:
        raise ValueError("; ".join(problems))
    return new


USER_CONFIG_KEYS = {"Ingress": ("acceleration", "loras"), "DiTReplica": ("loras",)}  # the Router's: its knobs


def check_user_config_shape(name: str, user_config) -> None:
    """Refuse a ``user_config`` of deployment ``name`` that is not a mapping, has a key the
    deployment does not read (``USER_CONFIG_KEYS``; the Router's knobs are checked by
    ``BatchingConfig``) or a section (``acceleration``, ``loras``) that is not a mapping. The
    Ingress's older flat form (a dict of acceleration fields alone) is checked by
    ``AccelerationConfig``; beside the nested form a flat field would be ignored, so it is
    refused. Raises ``ValueError``, e.g. ``"user_config has no X (it takes acceleration,
    loras)"``."""
    if not isinstance(user_config, dict):
        raise ValueError("user_config must be a mapping")
    allowed = USER_CONFIG_KEYS.get(name)
    if not allowed or (name == "Ingress" and not any(k in user_config for k in allowed)):
        return
    unknown = sorted(str(k) for k in user_config if k not in allowed)
    flat = [k for k in unknown if name == "Ingress" and k in AccelerationConfig.model_fields]
    if flat:  # the flat form's fields beside the nested form's sections
        raise ValueError(f"user_config has {', '.join(flat)} beside its sections ({', '.join(allowed)}): with "
                         "sections an acceleration field goes under acceleration (the flat form, acceleration "
                         "fields alone, has no sections)")
    if unknown:
        raise ValueError(f"user_config has no {', '.join(unknown)} (it takes {', '.join(allowed)})")
    for key in allowed:
        if user_config.get(key) is not None and not isinstance(user_config[key], dict):
            raise ValueError(f"user_config.{key} must be a mapping")


# AccelerationConfig fields the replicas read at their start (not request defaults)
REPLICA_STARTUP_FIELDS = ("torch_compile", "compile_backend", "warmup")


def ingress_update(user_config: dict, args_acceleration: dict, device: str, dtype: str, ring_degree: int,
                   default_steps: int) -> tuple["AccelerationConfig | None", dict[str, LoraEntry] | None]:
    """The Ingress's ``user_config`` update, checked: ``(acceleration, loras)``, each None when
    the update leaves it alone. ``user_config`` is ``{"acceleration": {...}, "loras": {...}}``
    or a dict of acceleration fields alone (the older form); an acceleration field it leaves
    out keeps ``args``' value (``args_acceleration``); the default kernel must run on
    ``device`` / ``dtype`` / ``ring_degree`` and stay ``args``' under ring attention or
    torch.compile (a request may not switch it there either); the replicas' startup fields
    (``REPLICA_STARTUP_FIELDS``) stay ``args``'; default Cache-DiT knobs must fit
    ``default_steps`` (helper-62: a user_config's passed unchecked until the model was known).
    Raises ``ValueError`` (pydantic's
    ``ValidationError`` for a bad field) naming what is wrong, also a key beside the nested
    form or a section that is not a mapping (``check_user_config_shape``)."""
    check_user_config_shape("Ingress", user_config)
    if "acceleration" not in user_config and "loras" not in user_config:
        user_config = {"acceleration": user_config}
    acceleration = loras = None
    if "acceleration" in user_config:
        acceleration = AccelerationConfig.model_validate({**args_acceleration, **(user_config["acceleration"] or {})})
        problem = (default_kernel_problem(acceleration.attention_backend, device, dtype, ring_degree)
                   or default_knobs_problem(acceleration, default_steps))
        if problem:
            raise ValueError(problem)
        started = AccelerationConfig.model_validate(args_acceleration)
        for name in REPLICA_STARTUP_FIELDS:  # the Ingress reads none of them: a change would be taken and ignored
            if getattr(acceleration, name) != getattr(started, name):
                raise ValueError(f"acceleration.{name} is set where the replicas start (args, {getattr(started, name)!r});"
                                 " a live Ingress update cannot change it: change args (a redeploy restarts the replicas)")
        fixed = [why for why, holds in ((f"parallel.ring_degree={ring_degree}", ring_degree > 1),
                                        ("acceleration.torch_compile on", started.torch_compile)) if holds]
        if fixed and acceleration.attention_backend != started.attention_backend:
            raise ValueError(f"acceleration.attention_backend: the replicas' kernel is fixed ({', '.join(fixed)}: "
                             "a request may not switch it either), so the default stays args' "
                             f"{started.attention_backend!r}; got {acceleration.attention_backend!r}")
    if "loras" in user_config:
        loras = lora_registry(user_config["loras"] or {})
    return acceleration, loras


def default_knobs_problem(acceleration: "AccelerationConfig", default_steps: int) -> str | None:
    """Why default Cache-DiT knobs do not fit ``limits.default_steps`` (None: they do), which
    needs no model; their fit to the model's blocks is the Ingress's once it knows the model (a
    request running knobs past them is a 400 naming the server's default)."""
    from pipeline.contract.limits import ServingLimits
    from pipeline.sampling import AccelerationDefaults

    return AccelerationDefaults.from_config(acceleration.model_dump()).cache_dit_problem(
        ServingLimits("", 1, 1, 1, default_steps, 0.0), model_known=False)


def default_kernel_problem(name: str | None, device: str, dtype: str, ring_degree: int) -> str | None:
    """Why ``acceleration.attention_backend`` = ``name`` cannot be the default kernel on
    ``model.device`` / ``model.dtype`` and ``parallel.ring_degree`` (None: it can; whether its
    package is installed is checked where the replica starts)."""
    if name is None:
        return None
    problems = default_kernel_rejections(name, device_type=device.split(":")[0], dtype=dtype,
                                         ring_degree=ring_degree, check_installed=False)
    if not problems:
        return None
    return (f"acceleration.attention_backend={name!r} cannot run with model.device={device!r}, model.dtype={dtype!r}, "
            f"parallel.ring_degree={ring_degree}: " + "; ".join(problems))
