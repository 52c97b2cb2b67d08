"""Middleware for Serve's HTTP proxy: the errors the proxy answers itself, as OpenAI envelopes.

Ray Serve's proxy answers some requests without reaching the Ingress: 429 when the Ingress's
own queue is full (``max_queued_requests``, the cheap first line of backpressure; the status
is the Ingress's ``backpressure_config``), 500 when the Ingress process died holding the
request, 408 on its request timeout. Those bodies are plain
text; this middleware rewrites every error response that is not already JSON into OpenAI's
error envelope, with ``Retry-After`` kept, and never echoes Serve's message (it can name
actors, processes and addresses).

Serve loads it in the proxy process from the environment variable
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy:middlewares`` (read when the
proxy starts: set it where the Ray cluster starts; ``ditserve serve``, the tests and the
KubeRay manifests do). Torch-free and light: the proxy imports it.
"""

from __future__ import annotations

import json
import os

from starlette.middleware import Middleware

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "deployments.proxy:middlewares"

# status -> (type, code, message) of the envelope the proxy's own errors become
_ERRORS = {
    408: ("timeout_error", "timeout", "the request took longer than the server's request timeout"),
    429: ("rate_limit_error", "overloaded", "the server is overloaded; retry after the Retry-After seconds"),
    500: ("server_error", "internal_error", "the process handling the request stopped; retry the request"),
    503: ("server_error", "overloaded", "the server is overloaded or restarting; retry after a moment"),
}


def envelope_for(status: int) -> bytes:
    kind, code, message = _ERRORS.get(status, ("server_error" if status >= 500 else "invalid_request_error",
                                               f"http_{status}", f"the request failed with HTTP status {status}"))
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class OpenAIErrorEnvelope:
    """ASGI middleware: an error response (status >= 400) whose body is not JSON is replaced by
    OpenAI's envelope for its status; JSON responses (every one the Ingress makes) pass as they are."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rewriting = {}

        async def send_rewritten(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"content-length"]
                content_type = dict(headers).get(b"content-type", b"")
                if not content_type.startswith(b"application/json"):
                    rewriting["status"] = message["status"]
                    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-type",)]
                    rewriting["headers"] = kept
                    return
            if rewriting and message["type"] == "http.response.body":
                if message.get("more_body"):
                    return  # drop the plain body; the envelope goes out once it has ended
                body = envelope_for(rewriting["status"])
                await send({"type": "http.response.start", "status": rewriting["status"],
                            "headers": [*rewriting["headers"], (b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, send_rewritten)


def middlewares() -> list[Middleware]:
    """What ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names: the proxy's middlewares."""
    return [Middleware(OpenAIErrorEnvelope)]


def install(environ=os.environ) -> None:
    """Ask Serve's proxy for these middlewares (call before the Ray cluster starts, e.g. before
    ``ray.init`` starts a local one; a value already set is left alone)."""
    environ.setdefault(CALLBACK_ENV, CALLBACK)
