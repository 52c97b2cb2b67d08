"""Ingress: the HTTP API (FastAPI through ``@serve.ingress``) and the Python handle methods.

Validation happens here, before anything is queued: a bad request is a 400 listing every
problem, and never reaches the router. Only this module maps errors to HTTP statuses. It
imports no torch (``tests/test_architecture.py``).
"""

import base64
import json
import re
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from pipeline.contract.images import (ImageData, ImageGenerationRequest, ImageGenerationResponse,
                                      validate_image_request)
from pipeline.contract.limits import ServingLimits
from pipeline.contract.videos import VideoGenerationRequest, VideoJob, validate_video_request
from pipeline.errors import DitServeError, InternalError, InvalidRequestError, ServiceUnavailableError
from pipeline.sampling import AccelerationDefaults, resolve, resolve_video
from pipeline.wire import GenerationMetadata

api = FastAPI(title="ditserve", description="Diffusion Transformer generation on Ray Serve")


def _unwrap(exc: BaseException) -> BaseException:
    """A Ray-wrapped error from the router or a replica → the error it carries."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def as_ditserve_error(exc: BaseException) -> DitServeError:
    """What a call into the Router raised, as the error the client gets: a ditserve error as it
    is; the Router's actor gone (stopping, dead, restarting) as 503 ``unavailable``; anything
    else as a 500 that names no internals."""
    cause = _unwrap(exc)
    if isinstance(cause, DitServeError):
        return cause
    if isinstance(cause, (RayActorError, ActorUnavailableError)) or isinstance(exc, (RayActorError,
                                                                                    ActorUnavailableError)):
        return ServiceUnavailableError("the router is unavailable (restarting or shutting down); retry shortly",
                                       code="unavailable")
    return InternalError(f"internal error ({type(cause).__name__})")


def error_response(exc: DitServeError) -> JSONResponse:
    retry_after = getattr(exc, "retry_after_s", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(exc.to_envelope(), status_code=exc.status_code, headers=headers)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own 404 / 405 (no such route or method) in OpenAI's error envelope."""
    return JSONResponse({"error": {"message": str(exc.detail), "type": "invalid_request_error", "param": None,
                                   "code": "not_found" if exc.status_code == 404 else "method_not_allowed"}},
                        status_code=exc.status_code)


@api.exception_handler(DitServeError)
async def _ditserve_error(_request: Request, exc: DitServeError) -> JSONResponse:
    return error_response(exc)


@api.exception_handler(Exception)
async def _unexpected_error(_request: Request, exc: Exception) -> JSONResponse:
    """Anything else: a 500 in OpenAI's envelope that names no internals (never a trace)."""
    return error_response(as_ditserve_error(exc))


_FORM_KEY = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])*)$")
_FORM_TEXT_FIELDS = {"prompt", "negative_prompt", "model", "size", "user", "seconds"}


def form_to_body(items: list[tuple[str, str]]) -> dict:
    """A multipart/url-encoded form (how OpenAI's SDK sends ``videos.create``) → a JSON body.

    Nested keys in bracket notation (``cache_dit_params[Fn_compute_blocks]=2``) become
    objects and a trailing ``[]`` appends to a list (``cache_dit_params[scm_cache_bins][]=2``); values of fields other than the text fields are read as JSON when they parse
    (``8`` → 8, ``true`` → True), else kept as text, and validation then names bad ones.
    """
    body: dict = {}
    for key, value in items:
        match = _FORM_KEY.match(key)
        if not match:
            raise InvalidRequestError(f"malformed form field name {key!r}", param=key)
        path = [match.group(1), *re.findall(r"\[([^\[\]]*)\]", match.group(2))]
        if "" in path[:-1]:
            raise InvalidRequestError(f"malformed form field name {key!r} ([] only at the end)", param=path[0])
        if not isinstance(value, str):
            raise InvalidRequestError(f"{path[0]}: file uploads are not supported", param=path[0])
        if path[0] not in _FORM_TEXT_FIELDS:
            try:
                value = json.loads(value)
            except ValueError:
                pass
        node = body
        parts, append = (path[:-1], True) if path[-1] == "" else (path, False)
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise InvalidRequestError(f"form field {key!r} mixes a value and an object", param=path[0])
        if append:
            node = node.setdefault(parts[-1], [])
            if not isinstance(node, list):
                raise InvalidRequestError(f"form field {key!r} mixes a value and a list", param=path[0])
            node.append(value)
        elif isinstance(node.get(parts[-1]), (dict, list)):
            raise InvalidRequestError(f"form field {key!r} mixes a value and an object", param=path[0])
        else:
            node[parts[-1]] = value
    return body


async def _video_body(request: Request) -> dict:
    content_type = request.headers.get("content-type", "")
    if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await request.form()
        return form_to_body(list(form.multi_items()))
    try:
        return json.loads(await request.body() or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", param="body") from None


@serve.deployment(num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    """HTTP routes and the handle API (``generate``; ``submit_video``, ``video_status``,
    ``video_content``, ``delete_video``; ``models``, ``stats``) of one application."""

    def __init__(self, router, config: dict):
        self._router = router
        self._config = config
        self._limits: ServingLimits | None = None
        self._defaults = AccelerationDefaults()

    def reconfigure(self, acceleration: dict) -> None:
        """Serve's ``user_config`` hook: new acceleration defaults apply to the next request."""
        self._defaults = AccelerationDefaults.from_config(acceleration)

    async def _serving_limits(self) -> ServingLimits:
        if self._limits is None:
            try:
                facts = await self._router.model_facts.remote()
            except Exception as exc:
                raise ServiceUnavailableError(f"no replica is ready yet ({type(_unwrap(exc)).__name__})",
                                              code="not_ready") from None
            self._limits = facts.limits(self._config["model"]["name"], self._config["limits"])
        return self._limits

    # -- handle API ---------------------------------------------------------------------
    async def generate(self, request: ImageGenerationRequest | dict) -> ImageGenerationResponse:
        """Generate images for one request (same contract as ``POST /v1/images/generations``).

        Raises ``InvalidRequestError`` (every problem listed), ``ModelNotFoundError``,
        ``OverloadedError``, ``ServiceUnavailableError`` or ``InternalError``.
        """
        started = time.perf_counter()
        limits = await self._serving_limits()
        validated = validate_image_request(request, limits)
        params = resolve(validated, limits, self._defaults)
        out = await self._call(self._router.submit, params)
        return ImageGenerationResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=base64.b64encode(image).decode("ascii")) for image in out.images],
            ditserve=GenerationMetadata.of(out, total_ms=(time.perf_counter() - started) * 1e3))

    async def submit_video(self, request: VideoGenerationRequest | dict) -> VideoJob:
        """Create a video job (same contract as ``POST /v1/videos``) and return it at once.

        Raises ``InvalidRequestError`` (every problem listed), ``ModelNotFoundError``,
        ``OverloadedError`` or ``ServiceUnavailableError``.
        """
        limits = await self._serving_limits()
        params = resolve_video(validate_video_request(request, limits), limits, self._defaults)
        return await self._call(self._router.create_job, params)

    async def video_status(self, video_id: str) -> VideoJob:
        """The job (``status``, ``progress`` 0–100, ...). Raises ``NotFoundError`` (404)."""
        return await self._call(self._router.get_job, video_id)

    async def video_content(self, video_id: str) -> bytes:
        """The finished job's MP4. Raises ``NotFoundError`` or ``InvalidRequestError`` (not completed)."""
        return await self._call(self._router.job_content, video_id)

    async def delete_video(self, video_id: str) -> dict:
        """Delete (and cancel) a job. Raises ``NotFoundError``."""
        return await self._call(self._router.delete_job, video_id)

    @staticmethod
    async def _call(method, *args):
        """Call the Router; raises the ditserve error the client gets (``as_ditserve_error``)."""
        try:
            return await method.remote(*args)
        except Exception as exc:
            raise as_ditserve_error(exc) from None

    async def models(self) -> dict:
        """OpenAI's model list: the one model this application serves."""
        return {"object": "list", "data": [
            {"id": self._config["model"]["name"], "object": "model", "created": 0, "owned_by": "ditserve"}]}

    async def stats(self) -> dict:
        return {"router": await self._router.stats.remote()}

    # -- HTTP routes --------------------------------------------------------------------
    @api.post("/v1/images/generations")
    async def http_generate(self, request: Request):
        try:
            body = json.loads(await request.body() or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"request body is not valid JSON: {exc}", param="body") from None
        return (await self.generate(body)).model_dump()

    @api.post("/v1/videos")
    async def http_create_video(self, request: Request):
        body = await _video_body(request)
        return (await self.submit_video(body)).model_dump()

    @api.get("/v1/videos")
    async def http_list_videos(self):
        return {"object": "list", "data": [job.model_dump() for job in await self._call(self._router.list_jobs)],
                "has_more": False}

    @api.get("/v1/videos/{video_id}")
    async def http_video(self, video_id: str):
        return (await self.video_status(video_id)).model_dump()

    @api.get("/v1/videos/{video_id}/content")
    async def http_video_content(self, video_id: str, variant: str = "video"):
        if variant != "video":
            raise InvalidRequestError(f"variant must be 'video' (the only asset served), got {variant!r}",
                                      param="variant")
        return Response(await self.video_content(video_id), media_type="video/mp4")

    @api.delete("/v1/videos/{video_id}")
    async def http_delete_video(self, video_id: str):
        return await self.delete_video(video_id)

    @api.get("/v1/models")
    async def http_models(self):
        return await self.models()

    @api.get("/v1/stats")
    async def http_stats(self):
        return await self.stats()

    @api.get("/health")
    async def http_health(self):
        await self._serving_limits()
        return {"status": "ok"}
