"""Middleware for Serve's HTTP proxy: the errors the proxy answers itself, as OpenAI envelopes,
and refusals of an app at its admission limit answered in the proxy at once.

Ray Serve's proxy answers some requests without reaching the Ingress: 429 when the Ingress's
own queue is full (``max_queued_requests``, the cheap first line of backpressure; the status
is the Ingress's ``backpressure_config``), 500 when the Ingress process died holding the
request, 408 on its request timeout. Those bodies are plain
text; this middleware rewrites every error response that is not already JSON into OpenAI's
error envelope, with ``Retry-After`` kept, and never echoes Serve's message (it can name
actors, processes and addresses).

:class:`AdmissionGate` answers 429 itself, before Serve routes the request, while the requests
the proxy has in flight to an app have reached that app's admission limit. Serve would refuse
them too, but only after its request router has tried the Ingress replica (an RPC), and while the
Ingress works through a burst's accepted requests those refusals waited hundreds of
milliseconds for it (``bench/overload.py``). Each ditserve Ingress names its limit and route
prefix in a response header (:data:`ADMISSION_HEADER`); the gate learns them from the first
response of each app and counts only what it forwards, so an app it knows nothing of, or one
served by several proxies (each sees a share), is left to Serve's own refusal.

:class:`IdleFullCollection` moves the proxy's full garbage collections (generation 2) out of
bursts: one ran 111 ms in the middle of ``bench/overload.py``'s burst, with a refusal p99 of 73 ms
(the slow refusals were exactly those that came during it); deferred to idle moments, p99 5-18 ms
in 14 of 15 runs.

:class:`BodyInScope` sends a small request body (at most :data:`BODY_IN_SCOPE_MAX_BYTES`, with a
``Content-Length``) to the Ingress inside the request's ASGI scope. Serve's proxy otherwise sends
the scope alone, and the Ingress's first read of the body is a call back to the proxy (a named
actor lookup, then an RPC: ~2-4 ms of every generation request on the 2-core development machine,
``bench/overhead.py``); larger bodies (uploads) keep that path. It reads every body whole before
the request goes on, and answers one that comes too slowly 408.

Serve loads it in the proxy process from the environment variable
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy:middlewares`` (read when the
proxy starts: set it where the Ray cluster starts; ``ditserve serve``, the tests and the
KubeRay manifests do). Torch-free and light: the proxy imports it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os

from ray.util.metrics import Counter
from starlette.middleware import Middleware

from deployments.memory import release_free_memory

# "<limit>; prefix=<route prefix>; epoch=<ns>": requests an app holds at once (the Router's live
# max_queued_requests plus a full batch per replica, at most what its Ingress takes), where
# it is mounted, and when the answering Ingress replica started (ns since the Unix epoch): a
# redeploy's new Ingress names a later epoch, and the gate ignores limits named by older ones.
ADMISSION_HEADER = b"x-ditserve-admission"

# A limit learned before the app had nothing in flight through this proxy for this long (seconds)
# is not enforced again until an answer confirms it: a redeploy (seconds at least) may have
# raised it, and the first burst after one must not be refused at the old app's limit.
ADMISSION_STALE_AFTER_IDLE_S = 5.0

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "deployments.proxy:middlewares"

# The proxy's full collections run once it has had nothing in flight this long (seconds) ...
FULL_COLLECTION_IDLE_S = 1.0
# ... or, under load that never pauses, after this many generation-1 collections (Python's
# threshold2; its default, 10, ran one every few hundred requests during a burst)
MAX_DEFERRED_GEN1_COLLECTIONS = 1000
# The largest body the proxy reads and sends inside the scope (bytes): every JSON generation
# request (a prompt and its knobs: well under 16 KiB); bigger ones, uploads, are fetched by the
# Ingress as Serve does.
BODY_IN_SCOPE_MAX_BYTES = 64 * 1024
# The scope key the body travels in (``deployments.http.read_body`` reads it).
BODY_SCOPE_KEY = "ditserve.body"
# A request body must have arrived BODY_READ_GRACE_S seconds after the request's headers plus
# one second per MIN_BODY_BYTES_PER_S bytes received: the proxy answers a slower one 408 and never
# passes it on. helper-75: bodies left unfinished (a Content-Length of 1000, 10 bytes sent) were
# passed to the Ingress after 5 s, each held one of its slots waiting for the rest, and 280 such
# connections left the app answering nothing, /health included, for as long as they stayed open.
BODY_READ_GRACE_S = 10.0
MIN_BODY_BYTES_PER_S = 4 * 1024
# Bodies the proxy holds until they have arrived whole (bytes): each one up to BODY_BUFFER_MAX_BYTES
# (the Ingress's max_body_bytes is 32 MiB by default; a larger declared body goes on at once, and
# the Ingress answers 413 from its Content-Length alone), all of them together up to
# BODY_BUFFER_BUDGET_BYTES (past it, a body goes on as far as it has come, the rest through Serve).
BODY_BUFFER_MAX_BYTES = 64 * 1024 * 1024
BODY_BUFFER_BUDGET_BYTES = 512 * 1024 * 1024

# status -> (type, code, message) of the envelope the proxy's own errors become (its 404: no app's
# route_prefix matches the path)
_ERRORS = {
    404: ("invalid_request_error", "route_not_found",
          "no application is deployed at this path: check the URL and the app's route_prefix (an app being "
          "deleted or not yet deployed answers so too)"),
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
    OpenAI's envelope for its status; JSON responses (every one the Ingress makes) pass as they are.
    A request left without any answer (Serve's proxy, when the Ingress died holding it, returns
    without one, and uvicorn would answer a plain 500), or an exception before one, is answered
    with the 500 envelope."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rewriting, answered = {}, []

        async def send_rewritten(message):
            if message["type"] == "http.response.start":
                answered.append(True)
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

        try:
            await self.app(scope, receive, send_rewritten)
        except Exception:
            if answered:
                raise  # the answer has begun: nothing else can be sent
            logging.getLogger("ray.serve").exception("the request failed before an answer; answering 500")
        if not answered:
            body = envelope_for(500)
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def admission_header(limit: int, route_prefix: str, epoch: int) -> tuple[bytes, bytes]:
    """The header an Ingress sends with every response (:class:`AdmissionGate` reads it):
    ``limit`` requests, the app's ``route_prefix``, ``epoch`` the Ingress replica's start (ns)."""
    return ADMISSION_HEADER, f"{limit}; prefix={route_prefix or '/'}; epoch={epoch}".encode()


def parse_admission(value: bytes) -> tuple[int, str, int] | None:
    """``(limit, route prefix, epoch)`` of an :data:`ADMISSION_HEADER` value (epoch 0 when
    absent), or None if malformed."""
    limit, *fields = (part.strip() for part in value.decode("latin-1").split(";"))
    named = dict(field.partition("=")[::2] for field in fields)
    prefix, epoch = named.get("prefix", ""), named.get("epoch", "0")
    digits = lambda text: text.isascii() and text.isdigit()  # noqa: E731 - int() refuses '²', isdigit() not
    if not prefix.startswith("/") or not digits(limit) or not digits(epoch) or set(named) - {"prefix", "epoch"}:
        return None
    return int(limit), prefix.rstrip("/") or "/", int(epoch)


class AdmissionGate:
    """ASGI middleware: 429 (OpenAI's envelope, ``Retry-After: 1``) at once for a request to an
    app whose requests in flight through this proxy have reached its admission limit.

    Limits and route prefixes are learned from :data:`ADMISSION_HEADER` on the app's responses
    (the longest prefix matching a path wins); only the API routes' POSTs (``<prefix>/v1/...``:
    the requests that bring work) are gated, so reads, deletes and requests to other apps and
    paths pass untouched. In flight: from the request's
    arrival here until its response's last body message is handed on or the client left. A limit is enforced only
    while confirmed: learned from an answer since the app last had nothing in flight here for
    :data:`ADMISSION_STALE_AFTER_IDLE_S` (a redeploy may have changed it). Until an answer
    confirms it again, requests pass to Serve: the Ingress takes a few more than the limit
    (``deployments.ingress.INGRESS_SPARE_SLOTS``), so the first over it reaches the Router, whose
    refusal (429, in the Ingress's time) names the limit and re-arms the gate. An answer from an
    Ingress that started before the newest one seen (its epoch; an old replica still draining
    after a redeploy) neither changes nor confirms the limit while the newest has answered within
    :data:`ADMISSION_STALE_AFTER_IDLE_S` (after that, it was scaled down, or its node's clock is
    ahead: the older one's answers count again; several live Ingress replicas name the same
    limit, so ignoring the older ones loses nothing). Between a redeploy and the first answer of its
    new Ingress while requests are in flight, the old limit still applies."""

    def __init__(self, app):
        self.app = app
        self.limits: dict[str, int] = {}     # route prefix -> admission limit
        self.in_flight: dict[str, int] = {}  # route prefix -> requests forwarded and not yet answered
        self.confirmed: set[str] = set()     # route prefixes whose limit is enforced
        self.idle_since: dict[str, float] = {}  # route prefix -> when its last request in flight ended
        self.epochs: dict[str, int] = {}     # route prefix -> the newest Ingress start (ns) seen answering
        self.epoch_heard: dict[str, float] = {}  # route prefix -> when that Ingress last answered
        # its refusals never reach the Router (whose rejections_total counts the rest); exported
        # by this proxy process as ray_ditserve_admission_refusals_total{route_prefix}
        self.refusals = Counter("ditserve_admission_refusals", "Requests the HTTP proxy answered 429 at an app's "
                                "admission limit, before Serve routed them", tag_keys=("route_prefix",))

    def learn_from(self, message) -> None:
        """Learn a limit and prefix from a response start's :data:`ADMISSION_HEADER`."""
        for name, value in message.get("headers", ()):
            if name.lower() == ADMISSION_HEADER:
                learned = parse_admission(value)
                if learned is not None:
                    limit, prefix, epoch = learned
                    now = asyncio.get_running_loop().time()
                    if (epoch < self.epochs.get(prefix, 0)
                            and now - self.epoch_heard[prefix] <= ADMISSION_STALE_AFTER_IDLE_S):
                        continue  # an older Ingress (draining after a redeploy): its limit may be stale
                    self.epochs[prefix], self.epoch_heard[prefix] = epoch, now
                    self.limits[prefix] = limit
                    self.confirmed.add(prefix)
                    if not self.in_flight.get(prefix):  # its first answer here: uncounted
                        self.idle_since[prefix] = asyncio.get_running_loop().time()

    def prefix_of(self, path: str) -> str | None:
        """The longest learned route prefix whose API (``<prefix>/v1/...``) ``path`` is in, or
        None (other apps' paths, and the app's ``/health`` and page, are left to Serve)."""
        best = None
        for prefix in self.limits:
            if path.startswith(prefix.rstrip("/") + "/v1/") and (best is None or len(prefix) > len(best)):
                best = prefix
        return best

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Only requests that bring work (POST: generations, edits, video jobs) are counted and
        # refused: a read (GET /v1/stats, /v1/models, a job's status) or a DELETE queues nothing
        # and takes one of the Ingress's spare slots for a moment (it was refused as "overloaded"
        # exactly when an operator looked at /v1/stats).
        prefix = self.prefix_of(scope["path"]) if scope.get("method") == "POST" else None
        if prefix is not None and not self.in_flight.get(prefix, 0):
            now = asyncio.get_running_loop().time()
            if now - self.idle_since.get(prefix, now) > ADMISSION_STALE_AFTER_IDLE_S:
                self.confirmed.discard(prefix)
        if prefix in self.confirmed and self.in_flight.get(prefix, 0) >= self.limits[prefix]:
            self.refusals.inc(tags={"route_prefix": prefix})
            body = envelope_for(429)
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        counted = prefix is not None
        if counted:
            self.in_flight[prefix] = self.in_flight.get(prefix, 0) + 1

        def release() -> None:
            nonlocal counted
            if counted:
                counted = False
                self.in_flight[prefix] -= 1
                if not self.in_flight[prefix]:
                    self.idle_since[prefix] = asyncio.get_running_loop().time()

        async def learn(message):
            if message["type"] == "http.response.start":
                self.learn_from(message)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # The slot is free before the client can read the answer's end: a client that
                # sends its next request on reading it (a refused one retried, a sequential
                # caller) was refused by its own finished request while Serve's handler wound down.
                release()
            await send(message)

        try:
            await self.app(scope, receive, learn)
        finally:
            release()


class IdleFullCollection:
    """ASGI middleware: the process's full garbage collections (generation 2, which scan every
    object the proxy holds: ~60-110 ms here with a burst in flight) run while it is idle rather
    than in the middle of a burst, where they stalled every request, refusals included.

    Construction raises Python's generation-2 threshold to :data:`MAX_DEFERRED_GEN1_COLLECTIONS`
    (generations 0 and 1, the young objects, are collected as before: Serve's proxy sets their
    threshold); once no HTTP request has been in flight for :data:`FULL_COLLECTION_IDLE_S`
    seconds after some were served, one ``gc.collect()`` runs on the event loop, and
    ``malloc_trim`` gives what a burst freed back to the OS (``bench/overload.py``: the proxy
    was +21 % resident after its burst; with the trim +10 %). A request that arrives during it
    waits for it (once per idle period)."""

    def __init__(self, app):
        self.app = app
        self.in_flight = 0
        self.served_since_collection = False
        self.timer: asyncio.TimerHandle | None = None
        gen0, gen1, _ = gc.get_threshold()
        gc.set_threshold(gen0, gen1, MAX_DEFERRED_GEN1_COLLECTIONS)

    def collect_if_idle(self) -> None:
        self.timer = None
        if self.in_flight == 0 and self.served_since_collection:
            self.served_since_collection = False
            release_free_memory()  # gc.collect(), then the freed memory back to the OS

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.served_since_collection = True
            if self.in_flight == 0:
                if self.timer is not None:
                    self.timer.cancel()
                self.timer = asyncio.get_running_loop().call_later(FULL_COLLECTION_IDLE_S, self.collect_if_idle)


class BodyInScope:
    """ASGI middleware: the proxy reads an HTTP request's body whole before the request goes on,
    so a client slow to send it holds no slot of the Ingress (Serve gives the Ingress a request
    at once, and it waited there for the body). A body not arrived :data:`BODY_READ_GRACE_S`
    after the headers plus a second per :data:`MIN_BODY_BYTES_PER_S` bytes received (a
    ``Content-Length`` or a chunked one) is answered 408 in OpenAI's envelope (``code``
    ``body_timeout``) and the connection closed; a client that leaves while sending goes on as
    received (Serve sees it as it would have). A body of at most :data:`BODY_IN_SCOPE_MAX_BYTES`
    is also sent on in ``scope[BODY_SCOPE_KEY]`` (bytes), so the Ingress need not call back to the
    proxy for it. Every body is replayed to Serve (its ``receive`` gives the same messages, then
    the client's disconnect as before). Bounds: :data:`BODY_BUFFER_MAX_BYTES` per body (a larger
    ``Content-Length`` goes on at once), :data:`BODY_BUFFER_BUDGET_BYTES` for all held at once."""

    def __init__(self, app):
        self.app = app
        self.held = 0  # bytes of bodies held here now
        self.timeouts = Counter("ditserve_proxy_body_timeouts", "Requests whose body arrived too slowly, "
                                "answered 408 by the proxy", tag_keys=())

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or ()) if scope["type"] == "http" else {}
        declared = headers.get(b"content-length")
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        if scope["type"] != "http" or (declared is None and not chunked) or (
                declared is not None and (not declared.isdigit() or int(declared) > BODY_BUFFER_MAX_BYTES)):
            await self.app(scope, receive, send)  # no body, or one Serve's path and the Ingress refuse
            return
        messages, chunks, received, complete = [], [], 0, False
        start = asyncio.get_running_loop().time()
        try:
            try:
                # one deadline, moved as the body comes (asyncio.wait_for makes a task per read)
                async with asyncio.timeout_at(start + BODY_READ_GRACE_S) as deadline:
                    while not complete:
                        deadline.reschedule(start + BODY_READ_GRACE_S + received / MIN_BODY_BYTES_PER_S)
                        message = await receive()
                        messages.append(message)
                        if message["type"] != "http.request":  # the client left: Serve sees it as it would have
                            break
                        chunks.append(message.get("body", b""))
                        received += len(chunks[-1])
                        self.held += len(chunks[-1])
                        complete = not message.get("more_body", False)
                        if not complete and self.held > BODY_BUFFER_BUDGET_BYTES:
                            break  # on as far as it has come, the rest through Serve's path
            except TimeoutError:
                self.timeouts.inc()
                await _answer_body_timeout(send, received)
                return
            if complete and received <= BODY_IN_SCOPE_MAX_BYTES and (declared is None or received == int(declared)):
                scope = {**scope, BODY_SCOPE_KEY: b"".join(chunks)}
            chunks.clear()

            async def replay():
                return messages.pop(0) if messages else await receive()

            await self.app(scope, replay, send)
        finally:
            self.held -= received


async def _answer_body_timeout(send, received: int) -> None:
    """408 in OpenAI's envelope for a body that came too slowly; the connection is closed (the
    rest of the body is never read)."""
    message = (f"the request body did not arrive in time ({received} bytes in): it must arrive within "
               f"{BODY_READ_GRACE_S:g} s plus 1 s per {MIN_BODY_BYTES_PER_S // 1024} KiB; send it whole at once")
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "body_timeout"}}).encode()
    await send({"type": "http.response.start", "status": 408,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def middlewares() -> list[Middleware]:
    """What ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names: the proxy's middlewares,
    innermost first (Serve wraps its app in each in turn, so the last one sees a request first:
    ``ray.serve._private.http_util._apply_middlewares``). The body is read first, so the gate
    counts only a request whose body has arrived and a client slow to send one takes none of the
    app's admission limit (helper-75); the gate's refusals and the 408 are answered there, in the
    envelope already; the envelope and the collector wrap what Serve's proxy itself answers and
    the requests it runs (the order ``bench/overload.py``'s figures in the README were measured
    with)."""
    return [Middleware(IdleFullCollection), Middleware(OpenAIErrorEnvelope), Middleware(AdmissionGate),
            Middleware(BodyInScope)]


def install(environ=os.environ) -> None:
    """Ask Serve's proxy for these middlewares (call before the Ray cluster starts, e.g. before
    ``ray.init`` starts a local one; a value already set is left alone)."""
    environ.setdefault(CALLBACK_ENV, CALLBACK)
