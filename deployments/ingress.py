"""Ingress: the HTTP API (FastAPI through ``@serve.ingress``) and the Python handle methods.

Validation happens here, before anything is queued: a bad request is a 400 listing every
problem, and never reaches the router. Only this module maps errors to HTTP statuses.
"""


import base64
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from pipeline.contract import (ImageData, ImageGenerationRequest, ImageGenerationResponse, ServingLimits,
                               parse_size, validate_image_request)
from pipeline.errors import DitServeError, InternalError, InvalidRequestError, OverloadedError, ServiceUnavailableError
from pipeline.sampling import AccelerationDefaults, resolve
from pipeline.accel import freeze_cache_dit_params

api = FastAPI(title="ditserve", description="Diffusion Transformer generation on Ray Serve")


def _unwrap(exc: BaseException) -> BaseException:
    """A Ray-wrapped error from the router or a replica → the ditserve error it carries."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, DitServeError) else exc


def error_response(exc: DitServeError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, OverloadedError) else None
    return JSONResponse(exc.to_envelope(), status_code=exc.status_code, headers=headers)


@api.exception_handler(DitServeError)
async def _ditserve_error(_request: Request, exc: DitServeError) -> JSONResponse:
    return error_response(exc)


@serve.deployment(num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    """HTTP routes and the handle API (``generate``, ``models``, ``stats``) of one application."""

    def __init__(self, router, config: dict):
        self._router = router
        self._config = config
        self._limits: ServingLimits | None = None
        self._defaults = AccelerationDefaults()

    def reconfigure(self, acceleration: dict) -> None:
        """Serve's ``user_config`` hook: new acceleration defaults apply to the next request."""
        acc = acceleration
        self._defaults = AccelerationDefaults(
            enable_cache_dit=acc["enable_cache_dit"],
            cache_dit_params=freeze_cache_dit_params(acc["cache_dit_params"]),
            cfg_gate_step=acc["cfg_gate_step"],
            attention_backend=acc["attention_backend"],
        )

    async def _serving_limits(self) -> ServingLimits:
        if self._limits is None:
            try:
                facts = await self._router.model_facts.remote()
            except Exception as exc:
                raise ServiceUnavailableError(f"no replica is ready yet ({type(_unwrap(exc)).__name__})",
                                              code="not_ready") from None
            lim = self._config["limits"]
            width, height = parse_size(lim["default_size"])
            self._limits = ServingLimits(
                model_name=self._config["model"]["name"], spatial_factor=facts.spatial_factor,
                default_width=width, default_height=height, default_steps=lim["default_steps"],
                default_guidance_scale=lim["default_guidance_scale"], max_n=lim["max_n"],
                max_pixels=lim["max_pixels"], max_steps=lim["max_steps"],
                max_prompt_chars=lim["max_prompt_chars"], guidance_embeds=facts.guidance_embeds,
                num_blocks=facts.num_blocks, attention_rejections=facts.attention_rejections,
                world_size=facts.world_size)
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
        try:
            out = await self._router.submit.remote(params)
        except Exception as exc:
            raise _unwrap(exc) from None
        metadata = {
            "request_id": out.request_id,
            **out.metadata,
            "seed": out.seed,
            "timings_ms": {**{k: round(v, 3) for k, v in out.timings_ms.items()},
                           "total": round((time.perf_counter() - started) * 1e3, 3)},
            "acceleration": out.acceleration,
        }
        return ImageGenerationResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=base64.b64encode(png).decode("ascii")) for png in out.pngs],
            ditserve=metadata)

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
        try:
            response = await self.generate(body)
        except DitServeError:
            raise
        except Exception as exc:
            cause = _unwrap(exc)
            if isinstance(cause, DitServeError):
                raise cause from None
            raise InternalError(f"internal error ({type(cause).__name__})") from None
        return response.model_dump()

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
