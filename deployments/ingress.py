"""Ingress: the HTTP API (FastAPI through ``@serve.ingress``) and the Python handle methods.

Validation happens here, before anything is queued: a bad request is a 400 listing every
problem, and never reaches the router. Only this module maps errors to HTTP statuses. It
imports no torch (``tests/test_architecture.py``).
"""

import asyncio
import base64
import contextvars
import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from ray import serve

from compat import CompatError
from compat.ray_serve import max_ongoing_requests as live_max_ongoing_requests
from deployments.config import AccelerationConfig, admission_limit_of, ingress_update, lora_registry
from deployments.live_config import LiveUpdates
from deployments.memory import IdleTrimmer
from deployments.http import (AdmissionHeader, BearerAuth, CrossSiteGuard, api_key_sets, as_ditserve_error,
                              caller_scope, idempotency_scope, install_error_handlers, json_body, json_or_form_body,
                              key_default_priority, query_params, request_body, request_fingerprint, single_header)
from deployments.serve_logs import answers_are_not_failures
from pipeline.contract.base import EDIT_FILES, VIDEO_FILES
from pipeline.contract.edits import ImageEditRequest, validate_edit_request
from pipeline.contract.images import ImageData, ImageGenerationRequest, ImageGenerationResponse, validate_image_request
from pipeline.contract.limits import ServingLimits
from pipeline.contract.lora import adapter_model_id
from pipeline.contract.text import shown
from pipeline.contract.videos import (LIST_PARAMS, ListOrder, VideoGenerationRequest, VideoJob, VideoList,
                                      validate_list_params, validate_video_request)
from pipeline.errors import InternalError, InvalidRequestError, ModelNotFoundError, ServiceUnavailableError
from pipeline.sampling import AccelerationDefaults, SamplingParams, resolve, resolve_edit, resolve_video
from pipeline.wire import GenerationMetadata

LEASE_RENEW_S = 1.0  # see Router.renew_lease
HEALTH_ROUTER_TIMEOUT_S = 5.0  # GET /health: how long the Router may take to answer (s)
# Ingress slots beyond the app's admission limit (deployments.app sizes max_ongoing_requests with
# them). Requests over the limit that the proxy's gate lets through (its limit unconfirmed after
# an idle spell: a redeploy may have changed it) reach the Router, which refuses them at once with
# the limit in its answer's header, re-arming the gate; with no spare slot they waited at Serve's
# door for a generation to end, and the gate for that answer.
INGRESS_SPARE_SLOTS = 4

# OpenAI's video content variants served -> media type (no spritesheet)
VIDEO_VARIANTS = {"video": "video/mp4", "thumbnail": "image/webp"}
# GET /v1/videos's query parameters as /openapi.json shows them (read from the query string and
# checked by Ingress.list_videos, whose messages name them: not FastAPI's coercion)
LIST_QUERY = [
    {"name": "limit", "in": "query", "required": False, "description": "jobs per page",
     "schema": {"type": "integer", "minimum": 0, "maximum": 100, "default": 20}},
    {"name": "after", "in": "query", "required": False, "description": "the previous page's last_id",
     "schema": {"type": "string"}},
    {"name": "order", "in": "query", "required": False, "description": "by created_at",
     "schema": {"type": "string", "enum": ["asc", "desc"], "default": "desc"}}]
PLAYGROUND = Path(__file__).resolve().parent / "playground.html"  # GET /: static HTML + plain JS
# its inline script and style; images as data: (previews) and blob: (a job's thumbnail), the video as blob:
PLAYGROUND_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                  "img-src data: blob:; media-src blob:; connect-src 'self' blob:; base-uri 'none'; "
                  "form-action 'none'; frame-ancestors 'none'")
EDIT_FILE_LISTS = ("image",)  # of EDIT_FILES, the one that may repeat (image[], or image given twice)


def named_admission_limit(max_queued_requests: int, max_batch_size: int, replicas: int,
                          max_ongoing_requests: int) -> tuple[int, int | None]:
    """``(limit, needed)``: the admission limit (requests) an Ingress replica names for the
    proxy's gate given the Router's live knobs and the most DiTReplica ``replicas``
    (:func:`deployments.config.admission_limit_of`), at most what its Serve
    ``max_ongoing_requests`` takes less :data:`INGRESS_SPARE_SLOTS` (and at least 1); ``needed``
    is the ``max_ongoing_requests`` that would take the whole limit when it does not (else None)."""
    wanted = admission_limit_of(max_queued_requests, max_batch_size, replicas)
    taken = max_ongoing_requests - INGRESS_SPARE_SLOTS
    if wanted <= taken:
        return wanted, None
    return max(1, taken), wanted + INGRESS_SPARE_SLOTS


def no_query_params(request: Request) -> None:
    """A route's dependency: it takes no query parameters, so any is a 400 naming it (a
    misspelt or misplaced field, ``?n=2`` instead of the body's ``n``, was ignored without a word)."""
    query_params(request, ())


NO_QUERY = [Depends(no_query_params)]


def sse(events) -> StreamingResponse:
    """OpenAI's image streaming events as Server-Sent Events (``event:`` type, ``data:`` JSON)."""
    return StreamingResponse((f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" async for e in events),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


api = FastAPI(title="ditserve", description="Diffusion Transformer generation on Ray Serve")
api.add_middleware(BearerAuth)
api.add_middleware(CrossSiteGuard)  # only where no keys are configured (see the class)
api.add_middleware(AdmissionHeader)  # outermost: every answer names the app's admission limit
install_error_handlers(api)


# The first route: a path with an empty segment is a 404. Starlette's redirect_slashes strips every
# trailing slash, so "/v1/videos/%2F" (client.videos.retrieve("/")) was a 307 to the job list, which
# the OpenAI SDK followed and read as a Video (helper-77). One trailing slash still redirects, as
# "/v1/stats/" does (helper-61).
@api.api_route("/{before:path}//{after:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
               include_in_schema=False)
async def _empty_path_segment(before: str, after: str):
    raise HTTPException(status_code=404)


# Operations of OpenAI's API (and its SDK's methods) that ditserve does not serve: a 400 saying so
# (they were a bare 404 "Not Found", read by the SDK as "no such video", or a 405), not listed in
# /openapi.json. (method, path, the SDK's method, what to do instead)
UNSERVED = (
    ("POST", "/v1/videos/{video_id}/remix", "videos.remix", "create a new video job with the changed prompt"),
    ("POST", "/v1/videos/edits", "videos.edit", "create a new video job (input_reference takes a first frame)"),
    ("POST", "/v1/videos/extensions", "videos.extend", "create a new video job"),
    ("POST", "/v1/videos/characters", "videos.create_character", "describe the character in the prompt"),
    ("GET", "/v1/videos/characters/{character_id}", "videos.get_character", "describe the character in the prompt"),
    ("POST", "/v1/images/variations", "images.create_variation",
     "use POST /v1/images/edits (image-to-image) with a prompt"),
)


def _refuse_unserved(operation: str, instead: str):
    async def refuse():
        raise InvalidRequestError(f"{operation} is not served by ditserve; {instead}", code="unsupported_operation")
    return refuse


for _method, _path, _operation, _instead in UNSERVED:
    api.add_api_route(_path, _refuse_unserved(_operation, _instead), methods=[_method], include_in_schema=False)


def body_of(request, fields: dict):
    """A handle call's request body: ``request`` (a dict or contract model), or the keyword
    ``fields`` given instead (``generate.remote(prompt="a red circle", size="64x64")``).
    Raises ``InvalidRequestError`` when both are given (which would win is not the caller's
    to guess)."""
    if not fields:
        return request
    if request is not None:
        raise InvalidRequestError(f"give the request as one dict or as keyword fields, not both (keywords: "
                                  f"{', '.join(sorted(map(str, fields)))})", code="invalid_value")
    return fields


def checked_video_id(video_id: object) -> str:
    """``video_id`` as given (a handle call may pass anything). Raises ``InvalidRequestError``
    naming ``video_id`` for one that is not a string (a list was a 500: the job store's key)."""
    if not isinstance(video_id, str):
        raise InvalidRequestError(f"video_id must be a string, a job's id as videos.create returned it (video_...), "
                                  f"got {shown(video_id)}", param="video_id", code="invalid_value")
    return video_id


@serve.deployment(num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    """HTTP routes and the handle API (``generate``, ``generate_stream``, ``edit``,
    ``edit_stream``; ``submit_video``, ``list_videos``, ``video_status``, ``video_content``,
    ``delete_video``; ``models``, ``stats``) of one application."""

    def __init__(self, router, config: dict):
        os.nice(config.get("routing_nice", 0))  # below the proxy, which answers refusals (replica.routing_nice)
        answers_are_not_failures()  # a handle caller's 400 is one log line, not a traceback
        self._router = router
        self._config = config
        self._limits: ServingLimits | None = None
        # args' request defaults from the start: a user_config without acceleration fields (loras
        # only, or none) keeps them (they were AccelerationDefaults()'s until one came)
        self._defaults = AccelerationDefaults.from_config(
            AccelerationConfig.model_validate(config.get("acceleration") or {}).model_dump())
        self._live = LiveUpdates("Ingress")
        self._loras = lora_registry(config["model"].get("loras") or {})
        limits = config["limits"]
        self._max_json_bytes = min(limits["max_json_body_bytes"], limits["max_body_bytes"])
        self._max_body_bytes = limits["max_body_bytes"]
        auth = config.get("auth") or {}
        keys, batch_keys = api_key_sets(auth)
        api.state.api_keys = tuple(k.encode() for k in (*keys, *batch_keys))
        api.state.batch_api_keys = tuple(k.encode() for k in batch_keys)
        api.state.admission_limit = config.get("admission_limit")  # for the proxy's AdmissionGate
        api.state.admission_epoch = time.time_ns()  # this replica's start: the gate trusts the newest
        self._most_replicas = config.get("most_replicas", 1)  # DiTReplicas at most (ReplicaConfig.most_replicas)
        self._capped_at: int | None = None  # the max_ongoing_requests last warned about
        self._caller = serve.get_replica_context().replica_id.unique_id
        self._lease: asyncio.Task | None = None
        try:  # from the start, so the first answers name the live limit (Serve builds replicas in its loop)
            self._lease = asyncio.get_running_loop().create_task(self._keep_lease(), context=contextvars.Context())
        except RuntimeError:  # no loop here: the first request starts it
            pass
        self._waiting = 0  # requests this replica has handed to the Router and not yet answered
        self._trimmer = IdleTrimmer(lambda: self._waiting)

    async def _keep_lease(self) -> None:
        """Tell the Router every second that this replica lives, so it keeps its requests; when
        this process dies, the Router drops (or stops) the work it was waiting for. Its answer,
        the Router's live admission knobs, sets the limit this replica's answers name."""
        while True:
            try:
                knobs = await self._router.renew_lease.remote(self._caller)
            except Exception:  # noqa: BLE001 - the Router is restarting: renew with the next one
                knobs = None
            if knobs is not None and api.state.admission_limit is not None:  # None: built without a limit
                self._follow_admission_limit(knobs)
            await asyncio.sleep(LEASE_RENEW_S)

    def _follow_admission_limit(self, knobs: dict) -> None:
        """Name the limit of the Router's live ``knobs`` in this replica's answers for the proxy's
        gate (:func:`named_admission_limit`), warning once per value when this replica's Serve
        ``max_ongoing_requests`` cannot take it all."""
        try:
            slots = live_max_ongoing_requests()
        except CompatError as exc:  # an untested Ray: the limit from args stays
            if not self._capped_at:
                self._capped_at = -1
                logging.getLogger("ray.serve").warning("the admission limit stays at its args value: %s", exc)
            return
        # The most replicas of args, or more where a deployments entry's count runs more (Serve applied it)
        replicas = max(self._most_replicas, knobs.get("replicas", 0))
        limit, needed = named_admission_limit(knobs["max_queued_requests"], knobs["max_batch_size"], replicas, slots)
        if needed is not None and self._capped_at != needed:
            self._capped_at = needed
            logging.getLogger("ray.serve").warning(
                "the Router admits %d requests but this Ingress takes %d (max_ongoing_requests %d less %d spare): "
                "requests beyond them wait at Serve's door. Set the Ingress's max_ongoing_requests to %d in the "
                "config file's deployments section.", needed - INGRESS_SPARE_SLOTS, limit, slots,
                INGRESS_SPARE_SLOTS, needed)
        api.state.admission_limit = limit

    def _started(self) -> None:
        """A request arrived: keep the Router's lease and this process's memory trimming going.
        (Admission itself is Serve's ``max_ongoing_requests`` in front, then the Router.)"""
        if self._lease is None:
            self._lease = asyncio.get_running_loop().create_task(self._keep_lease(), context=contextvars.Context())
        self._trimmer.busy()

    async def reconfigure(self, user_config: dict) -> None:
        """Serve's ``user_config`` hook: ``{"acceleration": {...}, "loras": {...}}`` (the
        acceleration request defaults and the LoRA adapter registry, ``model.loras``) apply to the
        next request. A dict of acceleration fields alone is accepted too (the older form). Both
        get the checks of the config file (``AccelerationConfig``, the default kernel on this
        model's device, dtype and ring degree, ``lora_registry``: ``ingress_update``), and, once
        the model is known, the default Cache-DiT knobs against its blocks, and against
        ``limits.default_steps`` where Cache-DiT is on by default (each request's steps are
        checked as it comes, ``check_cache_dit``); an update that fails them is
        refused and the settings in force stay (``deployments.live_config``; at start it raises
        ``ValueError``). An acceleration field the update leaves out keeps ``args``' value."""
        await self._live.apply(user_config, self._apply_user_config)

    def _apply_user_config(self, user_config: dict) -> None:
        model, parallel = self._config["model"], self._config.get("parallel") or {}
        acceleration, loras = ingress_update(user_config, self._config.get("acceleration") or {}, model["device"],
                                             model["dtype"], int(parallel.get("ring_degree", 1)),
                                             self._config["limits"]["default_steps"])
        if acceleration is not None:
            defaults = AccelerationDefaults.from_config(acceleration.model_dump())
            problem = defaults.cache_dit_problem(self._limits) if self._limits is not None else None  # model known
            if problem:
                raise ValueError(problem)
            self._defaults = defaults
        if loras is not None:  # checked before either changed: both change, or neither
            self._loras = loras
        if self._limits is not None:
            self._limits = dataclasses.replace(self._limits, loras=self._loras)

    async def check_health(self) -> None:
        """Serve's health check (also run once the start's ``reconfigure`` is done): from then on
        a bad ``user_config`` update is refused, not raised."""
        self._live.started()

    async def _serving_limits(self) -> ServingLimits:
        if self._limits is None:
            try:
                facts = await self._router.model_facts.remote()
            except Exception as exc:
                error = as_ditserve_error(exc)
                if isinstance(error, ServiceUnavailableError):  # the Router's own reason (gone, deleted, failed)
                    raise error from None
                raise ServiceUnavailableError(f"no replica is ready yet ({type(exc).__name__})",
                                              code="not_ready") from None
            self._limits = facts.limits(self._config["model"]["name"], self._config["limits"], self._loras)
        return self._limits

    # -- handle API ---------------------------------------------------------------------
    async def generate(self, request: ImageGenerationRequest | dict | None = None, /,
                       **fields) -> ImageGenerationResponse:
        """Generate images for one request (same contract as ``POST /v1/images/generations``):
        the body as one dict (or model), or its fields as keywords (``generate.remote(prompt=...,
        size=...)``, as the OpenAI SDK takes them; not both: 400).

        Raises ``InvalidRequestError`` (every problem listed), ``ModelNotFoundError``,
        ``OverloadedError``, ``ServiceUnavailableError`` or ``InternalError``.
        """
        started = time.perf_counter()
        params, _ = await self._image_params(body_of(request, fields), streamed=False)
        return await self._answer(params, started)

    async def edit(self, request: ImageEditRequest | dict | None = None, /, **fields) -> ImageGenerationResponse:
        """Edit images for one request (same contract as ``POST /v1/images/edits``; ``image``
        and ``mask`` as file bytes, ``bytes`` or ``bytearray``, several images as a list or
        tuple): image-to-image, inpainting with a ``mask``, or reference
        editing on a FLUX.1 Kontext model. Raises as ``generate`` does; a bad upload is an
        ``InvalidRequestError`` naming ``image`` or ``mask``."""
        started = time.perf_counter()
        params, _ = await self._image_params(body_of(request, fields), streamed=False, edit=True)
        return await self._answer(params, started)

    async def edit_stream(self, request: ImageEditRequest | dict | None = None, /, **fields):
        """``edit`` with OpenAI's image streaming events (``stream: true``), as ``generate_stream``
        does, typed ``image_edit.partial_image`` and ``image_edit.completed`` (OpenAI's edit events)."""
        started = time.perf_counter()
        params, _ = await self._image_params(body_of(request, fields), streamed=True, edit=True)
        async for event in self._events(params, started, edit=True):
            yield event

    async def _answer(self, params: SamplingParams, started: float) -> ImageGenerationResponse:
        self._waiting += 1
        try:
            out = await self._call(self._router.submit, params, self._caller)
        finally:
            self._waiting -= 1
        return ImageGenerationResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=base64.b64encode(image).decode("ascii")) for image in out.images],
            output_format=params.output_format, size=f"{params.width}x{params.height}",
            ditserve=GenerationMetadata.of(out, total_ms=(time.perf_counter() - started) * 1e3))

    async def _image_params(self, request, *, streamed: bool | None,
                            edit: bool = False) -> tuple[SamplingParams, bool]:
        """Validate and resolve an image request for ``generate`` / ``edit`` (``streamed=False``),
        their ``_stream`` methods (``True``) or an HTTP route (``None``: either); returns the
        params and whether the request streams (its ``stream``, given at the top level or in
        ``extra_body``: read after validation merged them). An edit's uploads are decoded off the
        event loop (Pillow), after the ``stream`` check."""
        limits = await self._serving_limits()
        self._started()
        validated = (validate_edit_request if edit else validate_image_request)(request, limits)
        if streamed is not None and validated.stream != streamed:
            method = "edit" if edit else "generate"
            raise InvalidRequestError(f"stream: true is answered by {method}_stream (HTTP: the same route), stream: "
                                      f"false by {method}", param="stream", code="invalid_value")
        if edit:
            return await asyncio.to_thread(resolve_edit, validated, limits, self._defaults), validated.stream
        return resolve(validated, limits, self._defaults), validated.stream

    async def generate_stream(self, request: ImageGenerationRequest | dict | None = None, /, **fields):
        """OpenAI's image streaming (``stream: true``): an async generator (call it through
        ``handle.options(stream=True)``) of event dicts: ``partial_images`` events of type
        ``image_generation.partial_image`` (``b64_json``, ``partial_image_index``, ``size``,
        ``output_format``, ``created_at``), then one ``image_generation.completed`` with the
        image and the ``ditserve`` metadata. A failure before the first event (bad input, a
        refusal, ``timeout_s`` passed in the queue) raises as ``generate`` does; a failure after
        it is an ``error`` event carrying OpenAI's error object."""
        started = time.perf_counter()
        params, _ = await self._image_params(body_of(request, fields), streamed=True)
        async for event in self._events(params, started):
            yield event

    async def _events(self, params: SamplingParams, started: float, *, edit: bool = False):
        """The events of one streamed request (types ``image_generation.*``, or ``image_edit.*``
        for an edit); raises the ditserve error of a failure before the first event."""
        kind = "image_edit" if edit else "image_generation"
        common = {"size": f"{params.width}x{params.height}", "output_format": params.output_format,
                  "quality": "auto", "background": "opaque"}
        self._waiting += 1
        stream, finished, sent, event = None, False, 0, {"type": ""}
        try:
            stream = self._router.options(stream=True).submit_stream.remote(params, self._caller)
            async for item in stream:
                if isinstance(item, dict):
                    preview = item["preview"]
                    event = {"type": f"{kind}.partial_image", "created_at": int(time.time()),
                             "b64_json": base64.b64encode(preview["images"][0]).decode("ascii"),
                             "partial_image_index": preview["partial_image_index"], **common}
                else:
                    meta = GenerationMetadata.of(item, total_ms=(time.perf_counter() - started) * 1e3)
                    event = {"type": f"{kind}.completed", "created_at": int(time.time()),
                             "b64_json": base64.b64encode(item.images[0]).decode("ascii"), **common,
                             "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                                       "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}},
                             "ditserve": meta.model_dump()}
                sent += 1
                yield event
            if not event["type"].endswith(".completed"):  # every accepted request gets one answer
                raise InternalError("the request's stream ended before its image")
            finished = True
        except Exception as exc:  # noqa: BLE001 - answered as OpenAI's stream error event once an event went out
            finished = True
            error = as_ditserve_error(exc)
            if not sent:
                raise error from None
            yield {"type": "error", **error.to_envelope()}
        finally:
            self._waiting -= 1
            if stream is not None and not finished:  # the client left: the Router drops the request
                stream.cancel()

    async def _http_image(self, body, *, edit: bool):
        """An image route's answer: the JSON response, or (``stream: true``) Server-Sent Events
        once the first event is there, so that a failure before it (a refusal, ``timeout_s``)
        is the usual JSON envelope with its HTTP status (and ``Retry-After``)."""
        started = time.perf_counter()
        params, streamed = await self._image_params(body, streamed=None, edit=edit)
        if not streamed:
            return (await self._answer(params, started)).model_dump()
        events = self._events(params, started, edit=edit)
        first = await anext(events)  # raises the error answered as the envelope

        async def all_events():
            yield first
            async for event in events:
                yield event
        return sse(all_events())

    async def submit_video(self, request: VideoGenerationRequest | dict | None = None, /, *,
                           idempotency_key: str | None = None, **fields) -> VideoJob:
        """Create a video job (same contract as ``POST /v1/videos``) and return it at once; the
        body as one dict (or model), or its fields as keywords, as ``generate`` takes them.
        ``idempotency_key`` (HTTP: the ``Idempotency-Key`` header): while the job it created is
        kept, the same key with the same request returns that job instead of a second one.

        Raises ``InvalidRequestError`` (every problem listed; a key used for another request),
        ``ModelNotFoundError``, ``OverloadedError`` or ``ServiceUnavailableError``.
        """
        key = idempotency_scope(idempotency_key, caller_scope(None))
        return await self._submit_video(body_of(request, fields), key)

    async def _submit_video(self, body, key: str | None) -> VideoJob:
        """``key``: the scoped ``Idempotency-Key`` (:func:`deployments.http.idempotency_scope`)."""
        limits = await self._serving_limits()
        validated = validate_video_request(body, limits)
        idempotency = None if key is None else (key, request_fingerprint(validated))
        if validated.input_reference is not None:  # decoded off the event loop (Pillow)
            params = await asyncio.to_thread(resolve_video, validated, limits, self._defaults)
        else:
            params = resolve_video(validated, limits, self._defaults)
        self._started()
        return await self._call(self._router.create_job, params, idempotency)

    async def list_videos(self, limit: int | None = None, after: str | None = None,
                          order: ListOrder | str | None = None) -> VideoList:
        """A page of the jobs kept (same contract as ``GET /v1/videos``, OpenAI's cursor page):
        at most ``limit`` (0–100, default 20) by ``created_at`` in ``order`` (``desc``, the
        default, or ``asc``), from the one after job ``after`` (the previous page's ``last_id``).
        Raises ``InvalidRequestError`` naming the bad parameter (``after``: no job kept)."""
        count, order = validate_list_params(limit, order)
        return await self._call(self._router.list_jobs, count, after, order)

    async def video_status(self, video_id: str) -> VideoJob:
        """The job (``status``, ``progress`` 0–100, ...). Raises ``NotFoundError`` (404), or
        ``InvalidRequestError`` for a ``video_id`` that is not a string."""
        return await self._call(self._router.get_job, checked_video_id(video_id))

    async def video_content(self, video_id: str, variant: str = "video") -> bytes:
        """The finished job's MP4 (``variant`` ``video``) or its thumbnail, the first frame as WebP
        (``thumbnail``, OpenAI's variant name). Raises ``NotFoundError``, or
        ``InvalidRequestError`` (not completed, another variant, a ``video_id`` not a string)."""
        checked_video_id(video_id)
        if not isinstance(variant, str) or variant not in VIDEO_VARIANTS:  # a handle call may pass anything
            raise InvalidRequestError(f"variant must be one of {', '.join(VIDEO_VARIANTS)} (the assets served), got "
                                      f"{shown(variant)}", param="variant", code="invalid_value")
        return await self._call(self._router.job_content, video_id, variant)

    async def delete_video(self, video_id: str) -> dict:
        """Delete (and cancel) a job. Raises ``NotFoundError``, or ``InvalidRequestError`` for a
        ``video_id`` that is not a string."""
        return await self._call(self._router.delete_job, checked_video_id(video_id))

    @staticmethod
    async def _call(method, *args):
        """Call the Router; raises the ditserve error the client gets (``as_ditserve_error``)."""
        try:
            return await method.remote(*args)
        except Exception as exc:
            raise as_ditserve_error(exc) from None

    async def models(self) -> dict:
        """OpenAI's model list: the model this application serves, then one entry per
        registered LoRA adapter (id ``"<base>:<adapter>"``, ``parent`` the base model); a
        request may name either as ``model``. An adapter every DiTReplica refused
        (``Router.refused_adapters``) is not listed."""
        base = self._config["model"]["name"]
        refused = await self._call(self._router.refused_adapters)
        adapters = [{"id": adapter_model_id(base, name), "object": "model", "created": 0, "owned_by": "ditserve",
                     "parent": base, "root": base} for name in sorted(set(self._loras) - refused)]
        return {"object": "list", "data": [{"id": base, "object": "model", "created": 0, "owned_by": "ditserve"},
                                           *adapters]}

    async def stats(self) -> dict:
        """``GET /v1/stats``: ``router`` (``Router.stats``: queues, batches in flight, replicas,
        counters) and ``ingress``, the answering Ingress replica's ``waiting``: requests it has
        handed to the Router and not yet answered (each Ingress replica counts its own), and the
        ``admission_limit`` its answers name for the proxy's gate (requests; None: none named);
        in each, ``live_update_refused``: the last ``user_config`` update refused, if any."""
        return {"router": await self._router.stats.remote(),
                "ingress": {"replica": self._caller, "waiting": self._waiting,
                            "admission_limit": api.state.admission_limit,
                            "live_update_refused": self._live.refused}}  # its last user_config update refused

    # -- HTTP routes --------------------------------------------------------------------
    @api.post("/v1/images/generations", openapi_extra=request_body(ImageGenerationRequest), dependencies=NO_QUERY)
    async def http_generate(self, request: Request):
        body = key_default_priority(await json_body(request, self._max_json_bytes), request)
        return await self._http_image(body, edit=False)

    @api.post("/v1/images/edits", openapi_extra=request_body(ImageEditRequest, forms=True), dependencies=NO_QUERY)
    async def http_edit(self, request: Request):
        body = await json_or_form_body(request, self._max_json_bytes, self._max_body_bytes, files=EDIT_FILES,
                                       json=False, file_lists=EDIT_FILE_LISTS)
        return await self._http_image(key_default_priority(body, request), edit=True)

    @api.post("/v1/videos", openapi_extra=request_body(VideoGenerationRequest, forms=True), dependencies=NO_QUERY)
    async def http_create_video(self, request: Request):
        body = await json_or_form_body(request, self._max_json_bytes, self._max_body_bytes, files=VIDEO_FILES)
        key = idempotency_scope(single_header(request, "Idempotency-Key"), caller_scope(request))
        return (await self._submit_video(key_default_priority(body, request), key)).model_dump()

    @api.get("/v1/videos", openapi_extra={"parameters": LIST_QUERY})
    async def http_list_videos(self, request: Request):
        params = query_params(request, LIST_PARAMS)  # refuses unknown and repeated ones
        return (await self.list_videos(params.get("limit"), params.get("after"), params.get("order"))).model_dump()

    @api.get("/v1/videos/{video_id}", dependencies=NO_QUERY)
    async def http_video(self, video_id: str):
        return (await self.video_status(video_id)).model_dump()

    @api.get("/v1/videos/{video_id}/content")
    async def http_video_content(self, video_id: str, request: Request, variant: str = "video"):
        query_params(request, ("variant",))
        content = await self.video_content(video_id, variant)
        return Response(content, media_type=VIDEO_VARIANTS[variant])

    @api.delete("/v1/videos/{video_id}", dependencies=NO_QUERY)
    async def http_delete_video(self, video_id: str):
        return await self.delete_video(video_id)

    @api.get("/v1/models", dependencies=NO_QUERY)
    async def http_models(self):
        return await self.models()

    @api.get("/v1/models/{model_id}", dependencies=NO_QUERY)
    async def http_model(self, model_id: str):
        """OpenAI's ``GET /v1/models/{model}`` (the SDK's ``models.retrieve``): the entry of
        ``GET /v1/models`` with that id, else a 404 (``ModelNotFoundError``) naming the served ones."""
        listed = (await self.models())["data"]
        found = next((m for m in listed if m["id"] == model_id), None)
        if found is None:
            raise ModelNotFoundError(f"model {shown(model_id)} is not served here; available: "
                                     f"{', '.join(repr(m['id']) for m in listed)}", param="model",
                                     code="model_not_found")
        return found

    @api.get("/v1/stats", dependencies=NO_QUERY)
    async def http_stats(self):
        return await self.stats()

    @api.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
    async def http_playground(self):
        """The playground page: a prompt, size/steps/seed and the accelerations, streamed previews
        and progress, the image or video with its ``ditserve`` metadata. Static (no data of the
        server's), so it is served without auth; its API calls carry the key typed into it.
        ``HEAD`` gets the headers alone (a load balancer's check; it was 401, or 405 with a key).
        Its Content-Security-Policy lets it reach this origin only and be framed by no page
        (helper-66: another site could frame it and have the user click "generate")."""
        return HTMLResponse(PLAYGROUND.read_text(), headers={
            "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
            "Content-Security-Policy": PLAYGROUND_CSP})

    @api.api_route("/health", methods=["GET", "HEAD"])
    async def http_health(self):
        """200 ``{"status": "ok"}`` while the app can take requests: its model's facts known and
        its Router answering; else the 503 a request would get (a readiness probe's path; a
        liveness probe should ask Serve's proxy, ``/-/healthz``)."""
        await self._serving_limits()
        try:  # the cheapest Router call there is; a handle waits while no Router replica runs
            await asyncio.wait_for(self._router.renew_lease.remote(self._caller), HEALTH_ROUTER_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(f"the router did not answer within {HEALTH_ROUTER_TIMEOUT_S:g} s",
                                          code="unavailable") from None
        except Exception as exc:  # noqa: BLE001 - its deployment failed, or its actor is gone
            raise as_ditserve_error(exc) from None
        return {"status": "ok"}
