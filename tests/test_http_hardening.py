"""The Ingress under abuse, through real Ray Serve and HTTP: body caps, media types, malformed
bodies, authentication, and the proxy's own errors, every answer in OpenAI's envelope."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from openai import AuthenticationError, OpenAI

from deployments.proxy import (BODY_SCOPE_KEY, AdmissionGate, BodyInScope, IdleFullCollection, OpenAIErrorEnvelope,
                               admission_header, parse_admission)
from tests.helpers import TINY_ARGS

pytestmark = pytest.mark.slow

KEY = "sk-test-0123456789"
LIMITS = {"max_json_body_bytes": 4096, "max_body_bytes": 65536}


def envelope(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture(scope="module")
def url(deploy, tmp_path_factory):
    keys = tmp_path_factory.mktemp("auth") / "keys"
    keys.write_text(f"{KEY}\nsk-other\n")
    batch_keys = keys.parent / "batch-keys"
    batch_keys.write_text("sk-batch-0\n")
    return deploy({**TINY_ARGS, "limits": LIMITS,
                   "auth": {"api_keys_file": str(keys), "batch_api_keys_file": str(batch_keys)}})


@pytest.fixture(scope="module")
def authed(url):
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_keys_are_required_and_compared(url, authed):
    body = {"prompt": "a red circle", "seed": 1, "num_inference_steps": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        r = httpx.post(f"{url}/v1/images/generations", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and envelope(r)["code"] == "invalid_api_key"
    assert authed.post("/v1/images/generations", json=body).status_code == 200
    for pair in ((f"Bearer {KEY}", "Bearer wrong"), ("Bearer wrong", f"Bearer {KEY}")):  # the last one won (helper-59)
        r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=60,
                       headers=[("Authorization", pair[0]), ("Authorization", pair[1])])
        assert r.status_code == 401 and envelope(r)["message"].endswith("once (it came 2 times)"), r.text
    batch = httpx.post(f"{url}/v1/images/generations", json=body, headers={"Authorization": "Bearer sk-batch-0"},
                       timeout=60)
    assert batch.status_code == 200  # a batch key is a key (its requests default to priority batch)
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200  # probes need no key
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/models", "/v1/stats", "/v1/videos/x",
                 "/v1/videos/health", "/nothing/health"):  # (any path ending /health passed without a key)
        assert httpx.get(f"{url}{path}", timeout=60).status_code == 401, path
    assert httpx.delete(f"{url}/v1/videos/health", timeout=60).status_code == 401
    for method in ("POST", "PUT", "DELETE"):  # only GET / HEAD of /health and / are open (any method on /health was)
        for path in ("/health", "/"):
            assert httpx.request(method, f"{url}{path}", timeout=60).status_code == 401, (method, path)
    for path in ("/", "/health"):  # HEAD (a load balancer's check) was 401 without a key, 405 with one
        for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
            r = httpx.head(f"{url}{path}", headers=headers, timeout=60)
            assert (r.status_code, r.content) == (200, b""), (path, headers, r.status_code)
    assert httpx.head(f"{url}/", timeout=60).headers["content-type"].startswith("text/html")
    assert httpx.head(f"{url}/v1/models", timeout=60).status_code == 401
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.images.generate(prompt="a", response_format="b64_json",
                                  extra_body={"num_inference_steps": 2}).data
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).images.generate(prompt="a")


def test_bodies_over_the_cap_are_413_before_parsing(authed):
    big = b'{"prompt": "' + b"x" * 10_000 + b'"}'
    r = authed.post("/v1/images/generations", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and envelope(r)["code"] == "body_too_large"

    def chunks():  # no Content-Length: the cap applies while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 1000
        yield b'"}'

    r = authed.post("/v1/images/generations", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = authed.post("/v1/videos", content=b"x" * 70_000, headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 413  # forms have the larger cap, uploads included, and still one
    assert authed.post("/v1/images/generations", json={"prompt": "after", "num_inference_steps": 2}).status_code == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "application/xml"])
def test_generations_take_json_only(authed, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = authed.post("/v1/images/generations", content=b'{"prompt": "a"}', headers=headers)
    assert r.status_code == 415 and envelope(r)["code"] == "unsupported_media_type"  # no CSRF by simple POST


def test_malformed_bodies_are_400_envelopes(authed):
    deep = "[" * 1900 + "]" * 1900  # under the 4 KB cap, deeper than the JSON parser goes
    r = authed.post("/v1/images/generations", content=deep.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and envelope(r)["code"] == "invalid_json"
    r = authed.post("/v1/videos", content=b"--b\r\nContent-Disposition: form-data; name=\r\n",
                    headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 400 and envelope(r)["code"] in ("invalid_form", "wrong_endpoint")
    r = authed.post("/v1/images/generations", content=b'{"prompt": "\\ud800"}',
                    headers={"content-type": "application/json"})  # a lone surrogate, escaped in JSON
    error = envelope(r)
    assert r.status_code == 400 and error["param"] == "prompt" and "surrogate" in error["message"]
    r = authed.post("/v1/images/generations", json={"prompt": "a", "guidance_scale": 3.5e38})
    assert r.status_code == 400 and envelope(r)["param"] == "guidance_scale"
    r = authed.get("/v1/videos/x/nothing")  # (remix is OpenAI's, refused as unsupported_operation: test_hardening)
    assert r.status_code == 404 and envelope(r)["code"] == "not_found"
    assert envelope(r)["message"] == "no route '/v1/videos/x/nothing' (GET /docs lists the API)"
    # a 405 keeps Starlette's Allow header (RFC 9110) and names the methods (helper-59: both were lost)
    for method, path, allowed in (("PUT", "/v1/images/generations", "POST"), ("POST", "/v1/models", "GET"),
                                  ("PATCH", "/v1/videos", "GET, POST")):
        r = authed.request(method, path, json={})
        assert r.status_code == 405 and envelope(r)["code"] == "method_not_allowed", (method, path)
        assert r.headers["allow"] == allowed
        assert envelope(r)["message"] == f"{method} is not allowed on '{path}'; it takes {allowed}"


def test_the_proxy_middleware_turns_plain_errors_into_envelopes():
    """What Serve's proxy answers by itself (backpressure, a dead Ingress) is plain text: the
    middleware makes it OpenAI's envelope, keeping the status and Retry-After, and leaves JSON alone."""

    async def plain(scope, receive, send):
        status = int(scope["path"].strip("/"))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": b"Request dropped due to backpressure (actor 1.2.3.4)"})

    async def json_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {"message": "ours"}}'})

    async def dies(scope, receive, send):
        raise RuntimeError("actor 1.2.3.4 died")

    async def silent(scope, receive, send):  # Serve's proxy when the Ingress died holding the request
        return

    async def run():
        for app in (dies, silent):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(OpenAIErrorEnvelope(app)),
                                         base_url="http://t") as c:
                died = await c.post("/v1/images/generations")
                assert died.status_code == 500 and envelope(died)["code"] == "internal_error"
                assert "1.2.3.4" not in died.text
        async with httpx.AsyncClient(transport=httpx.ASGITransport(OpenAIErrorEnvelope(plain)), base_url="http://t") as c:
            answers = {s: await c.get(f"/{s}") for s in (429, 500, 503, 408, 404)}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(OpenAIErrorEnvelope(json_app)),
                                     base_url="http://t") as c:
            ours = await c.get("/")
        return answers, ours

    answers, ours = asyncio.run(run())
    for status, r in answers.items():
        error = envelope(r)
        assert r.status_code == status and "1.2.3.4" not in r.text and error["code"]
    assert answers[429].headers["retry-after"] == "1" and envelope(answers[429])["type"] == "rate_limit_error"
    # helper-47: the proxy's 404 (no app at the path, also while one is deleted) said only its status
    assert envelope(answers[404])["code"] == "route_not_found" and "route_prefix" in envelope(answers[404])["message"]
    assert ours.json() == {"error": {"message": "ours"}}


def _app_of_limit_2_holding_its_api_until(release: asyncio.Event):
    """An ASGI app whose answers name the admission limit 2 at ``/`` (or ``?limit=L&epoch=E``:
    an Ingress started at E naming L), holding its ``/v1`` requests (but ``/v1/models``) until
    ``release`` is set."""
    async def app(scope, receive, send):
        if scope["path"].startswith("/v1/") and scope["path"] != "/v1/models":
            await release.wait()
        asked = dict(pair.split("=") for pair in scope["query_string"].decode().split("&") if pair)
        header = admission_header(int(asked.get("limit", 2)), "", int(asked.get("epoch", 1)))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), header]})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def test_the_admission_gate_refuses_at_the_learned_limit():
    """The gate learns an app's limit and prefix from its answers' header, counts the API
    requests it forwards, answers 429 (envelope, Retry-After) at once at the limit, lets them
    through again when one finishes, and leaves reads (a GET of /v1/models was refused as
    overloaded at the limit), other paths and unknown apps alone."""
    assert parse_admission(admission_header(264, "", 17)[1]) == (264, "/", 17)
    assert parse_admission(b"8; prefix=/bs1/") == (8, "/bs1", 0)
    for malformed in (b"eight; prefix=/", b"8", b"8; prefix=/; epoch=x", b"8; prefix=/; other=1",
                      b"8; prefix=/; epoch=\xb2", b"\xb2; prefix=/"):
        assert parse_admission(malformed) is None, malformed
    release = asyncio.Event()
    gate = AdmissionGate(_app_of_limit_2_holding_its_api_until(release))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(OpenAIErrorEnvelope(gate)),
                                     base_url="http://t") as c:
            held = [asyncio.ensure_future(c.post("/v1/images/generations")) for _ in range(2)]
            await asyncio.sleep(0.05)
            assert gate.prefix_of("/v1/images/generations") is None  # no answer seen yet
            assert (await c.get("/v1/models")).status_code == 200  # an answer: limit 2 at "/"
            assert gate.prefix_of("/v1/images/generations") == "/" and gate.prefix_of("/health") is None
            more = [asyncio.ensure_future(c.post("/v1/images/generations")) for _ in range(2)]
            await asyncio.sleep(0.05)
            assert gate.in_flight["/"] == 2 and not any(f.done() for f in more)  # counted from now on
            refused = await c.post("/v1/images/generations")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert envelope(refused)["code"] == "overloaded"
            assert (await c.get("/health")).status_code == 200  # not the API: passes
            assert (await c.get("/v1/models")).status_code == 200  # a read brings no work: passes
            assert gate.in_flight["/"] == 2
            release.set()
            answers = await asyncio.gather(*held, *more)
            assert [r.status_code for r in answers] == [200] * 4 and gate.in_flight["/"] == 0
            assert (await c.post("/v1/images/generations")).status_code == 200

    asyncio.run(run())


def test_the_admission_gate_frees_a_slot_before_the_client_reads_the_answer_end():
    """A request's slot is free when its last body message is handed on, not when Serve's
    handler returns after it: a client that sends its next request on reading an answer (a
    sequential caller at the limit) was refused by its own finished request (seen as a 429 for
    an interactive request right after a refused one, in CI)."""
    linger = asyncio.Event()

    async def app(scope, receive, send):  # answers, then winds down for a while, as Serve's handler may
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), admission_header(1, "", 1)]})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        await send({"type": "http.response.body", "body": b"}"})
        await linger.wait()

    gate = AdmissionGate(app)

    async def run():
        seen = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            seen.append((message["type"], message.get("more_body", False), dict(gate.in_flight)))

        async def request():
            scope = {"type": "http", "method": "POST", "path": "/v1/images/generations", "query_string": b"",
                     "headers": []}
            await gate(scope, receive, send)

        learned = asyncio.ensure_future(request())  # teaches the limit 1 (nothing counted yet)
        await asyncio.sleep(0.05)
        linger.set()
        await learned
        linger.clear()
        seen.clear()
        first = asyncio.ensure_future(request())
        await asyncio.sleep(0.05)
        assert not first.done()  # the app is still winding down
        assert seen == [("http.response.start", False, {"/": 1}), ("http.response.body", True, {"/": 1}),
                        ("http.response.body", False, {"/": 0})]  # freed before the answer's end goes out
        second = asyncio.ensure_future(request())  # at the limit 1, the first's answer read
        await asyncio.sleep(0.05)
        assert seen[3] == ("http.response.start", False, {"/": 1})  # not a 429: passed to the app
        linger.set()
        await asyncio.gather(first, second)
        assert gate.in_flight["/"] == 0  # each counted out once

    asyncio.run(run())


def test_the_admission_gate_enforces_a_limit_learned_before_an_idle_spell_only_once_confirmed(monkeypatch):
    """An app redeployed with a higher limit while nothing was in flight: the first burst is not
    refused at the old limit (it was: 6 of 12 requests answered 429 by the proxy, the new app
    holding 72); once an answer confirms the limit, the gate refuses at it again."""
    from deployments import proxy

    monkeypatch.setattr(proxy, "ADMISSION_STALE_AFTER_IDLE_S", 0.1)
    release = asyncio.Event()
    gate = AdmissionGate(_app_of_limit_2_holding_its_api_until(release))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(gate), base_url="http://t") as c:
            assert (await c.get("/v1/models")).status_code == 200  # limit 2 learned and confirmed
            await asyncio.sleep(0.2)  # idle for longer than the limit is trusted
            burst = [asyncio.ensure_future(c.post("/v1/images/generations")) for _ in range(3)]
            await asyncio.sleep(0.05)
            assert gate.in_flight["/"] == 3 and not any(f.done() for f in burst)  # none refused: unconfirmed
            assert (await c.get("/v1/models")).status_code == 200  # an answer (the Router's 429 live) confirms it
            refused = await c.post("/v1/images/generations")
            assert refused.status_code == 429  # 3 in flight >= 2
            release.set()
            assert [r.status_code for r in await asyncio.gather(*burst)] == [200] * 3

    asyncio.run(run())


def test_the_admission_gate_ignores_the_limit_an_older_ingress_names_after_a_redeploy(monkeypatch):
    """A redeploy raised the limit from 2 to 4: once the new Ingress (a later epoch) has
    answered, an answer from the old one, still draining, neither lowers the limit again nor
    re-arms the gate at it (it did: the gate refused at 2 until the next new answer). Once the
    newest has been silent for longer than the limit is trusted (scaled down, or its clock was
    ahead), an older one's answers count again."""
    from deployments import proxy

    monkeypatch.setattr(proxy, "ADMISSION_STALE_AFTER_IDLE_S", 0.5)
    release = asyncio.Event()
    gate = AdmissionGate(_app_of_limit_2_holding_its_api_until(release))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(gate), base_url="http://t") as c:
            assert (await c.get("/v1/models?limit=2&epoch=100")).status_code == 200
            assert gate.limits["/"] == 2
            assert (await c.get("/v1/models?limit=4&epoch=200")).status_code == 200  # the new Ingress
            assert (await c.get("/v1/models?limit=2&epoch=100")).status_code == 200  # the old one, draining
            assert gate.limits["/"] == 4 and gate.epochs["/"] == 200
            held = [asyncio.ensure_future(c.post("/v1/images/generations?limit=4&epoch=200")) for _ in range(4)]
            await asyncio.sleep(0.05)
            assert gate.in_flight["/"] == 4 and not any(f.done() for f in held)  # 3 and 4 not refused at 2
            assert (await c.post("/v1/images/generations")).status_code == 429  # at 4: refused
            release.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 4
            await asyncio.sleep(0.6)  # epoch 200 silent for longer than the limit is trusted
            assert (await c.get("/v1/models?limit=3&epoch=100")).status_code == 200
            assert gate.limits["/"] == 3 and gate.epochs["/"] == 100

    asyncio.run(run())


@pytest.mark.parametrize("knobs, replicas, max_ongoing_requests, expected", [
    ((64, 8), 1, 72 + 4, (72, None)),      # the app as built: limit + 4 spare slots
    ((64, 8), 1, 100, (72, None)),         # more slots than needed: the Router's limit
    ((64, 8), 4, 96 + 4, (96, None)),      # autoscaling: a batch per replica it may start
    ((128, 8), 1, 72 + 4, (72, 140)),      # a live raise beyond the slots: capped, 140 named
    ((2, 4), 1, 4, (1, 10)),               # no slot beyond the spare ones: still 1
])
def test_the_admission_limit_an_ingress_names(knobs, replicas, max_ongoing_requests, expected):
    from deployments.ingress import named_admission_limit

    max_queued_requests, max_batch_size = knobs
    assert named_admission_limit(max_queued_requests, max_batch_size, replicas, max_ongoing_requests) == expected


def test_the_proxy_collects_garbage_fully_only_when_idle(monkeypatch):
    """Generation-2 collections (one stalled a burst's refusals for 111 ms) wait until the proxy
    has had nothing in flight for FULL_COLLECTION_IDLE_S; then exactly one runs, and none while
    idle without traffic. Generation 0 and 1 thresholds are left as they were."""
    import gc

    from deployments import proxy

    monkeypatch.setattr(proxy, "FULL_COLLECTION_IDLE_S", 0.2)
    before = gc.get_threshold()
    release = asyncio.Event()

    async def app(scope, receive, send):
        if scope["path"] == "/slow":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    def full_collections() -> int:
        return gc.get_stats()[2]["collections"]

    try:
        collector = IdleFullCollection(app)
        assert gc.get_threshold() == (before[0], before[1], proxy.MAX_DEFERRED_GEN1_COLLECTIONS)

        async def run():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(collector), base_url="http://t") as c:
                start = full_collections()
                slow = asyncio.ensure_future(c.get("/slow"))
                await c.get("/fast")
                await asyncio.sleep(0.4)  # one request still in flight: not idle
                assert collector.in_flight == 1 and full_collections() == start
                release.set()
                assert (await slow).status_code == 200
                await asyncio.sleep(0.1)  # idle for less than FULL_COLLECTION_IDLE_S
                assert full_collections() == start
                await asyncio.sleep(0.3)
                assert full_collections() == start + 1
                await asyncio.sleep(0.4)  # idle with nothing served since: no other collection
                assert full_collections() == start + 1

        asyncio.run(run())
    finally:
        gc.set_threshold(*before)


async def _echo(scope, receive, send):
    """An ASGI app answering what reached it: the body the scope carries (or null) and the body read."""
    import json

    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    sent = scope.get(BODY_SCOPE_KEY)
    body = json.dumps({"in_scope": None if sent is None else sent.decode(), "read": b"".join(chunks).decode()})
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body.encode()})


def test_the_proxy_sends_small_bodies_in_the_scope(monkeypatch):
    """``BodyInScope``: a body up to BODY_IN_SCOPE_MAX_BYTES (with a Content-Length or chunked)
    travels in the scope (and is still replayed to ``receive``), a bigger one is replayed only;
    ``read_body`` takes the scope's body under the same cap as a read one (413 beyond it)."""
    from deployments import proxy
    from deployments.http import read_body
    from pipeline.errors import PayloadTooLargeError

    monkeypatch.setattr(proxy, "BODY_IN_SCOPE_MAX_BYTES", 100)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(BodyInScope(_echo)), base_url="http://t") as c:
            small = await c.post("/v1/images/generations", content=b'{"prompt": "a"}')
            assert small.json() == {"in_scope": '{"prompt": "a"}', "read": '{"prompt": "a"}'}
            big = await c.post("/v1/images/generations", content=b"x" * 101)
            assert big.json() == {"in_scope": None, "read": "x" * 101}

            async def chunked():
                yield b"ab"
                yield b"cd"

            streamed = await c.post("/v1/images/generations", content=chunked())
            assert streamed.json() == {"in_scope": "abcd", "read": "abcd"}

        from starlette.requests import Request

        async def nothing():
            raise AssertionError("read_body used the scope's body")

        request = Request({"type": "http", "headers": [], BODY_SCOPE_KEY: b"x" * 50}, nothing)
        assert await read_body(request, 50) == b"x" * 50
        with pytest.raises(PayloadTooLargeError):
            await read_body(request, 49)

    asyncio.run(run())


def _slow_body(declared: int, second_part_after_s: float | None):
    """``(scope, receive)`` of a POST declaring ``declared`` bytes whose body comes as ``ab``, then
    ``cd`` after ``second_part_after_s`` seconds (None: never)."""
    parts = [{"type": "http.request", "body": b"ab", "more_body": True},
             {"type": "http.request", "body": b"cd", "more_body": False}]
    gate = asyncio.Event()
    if second_part_after_s is not None:
        asyncio.get_running_loop().call_later(second_part_after_s, gate.set)

    async def receive():
        if len(parts) == 1:
            await gate.wait()
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    return {"type": "http", "method": "POST", "path": "/v1/images/generations",
            "headers": [(b"content-length", str(declared).encode())]}, receive


@pytest.mark.parametrize("case", ["in time", "too slow", "declared past the buffer", "past the budget"])
def test_a_body_that_comes_too_slowly_is_answered_408_by_the_proxy_and_never_passed_on(monkeypatch, case):
    """helper-75: bodies never finished (Content-Length 1000, 10 bytes sent) went on to the Ingress
    after 5 s and each held one of its slots; 280 of them left the app answering nothing, /health
    included. The proxy now reads a body whole before the request goes on, and one not arrived
    BODY_READ_GRACE_S plus a second per MIN_BODY_BYTES_PER_S bytes after the headers is a 408 in
    the envelope (connection closed), the app never called. A body declared past
    BODY_BUFFER_MAX_BYTES goes on at once (the Ingress refuses it by its length), and one past the
    budget of bodies held goes on as far as it has come."""
    from deployments import proxy

    monkeypatch.setattr(proxy, "BODY_READ_GRACE_S", 0.2)
    monkeypatch.setattr(proxy, "BODY_BUFFER_MAX_BYTES", 100 if case == "declared past the buffer" else 1000)
    monkeypatch.setattr(proxy, "BODY_BUFFER_BUDGET_BYTES", 1 if case == "past the budget" else 1000)
    declared = 400 if case == "declared past the buffer" else 4

    async def run():
        scope, receive = _slow_body(declared, None if case == "too slow" else 0.1 if case == "in time" else 0.4)
        sent, called = [], []

        async def send(message):
            sent.append(message)

        async def app(scope, receive, send):
            called.append(True)
            await _echo(scope, receive, send)

        middleware = BodyInScope(app)
        await middleware(scope, receive, send)
        assert middleware.held == 0
        return sent, called

    sent, called = asyncio.run(run())
    if case == "too slow":
        assert not called and sent[0]["status"] == 408
        assert (b"connection", b"close") in sent[0]["headers"]
        error = json.loads(sent[1]["body"])["error"]
        assert error["code"] == "body_timeout" and "2 bytes in" in error["message"], error
        return
    assert called and json.loads(sent[1]["body"]) == {"in_scope": "abcd" if case == "in time" else None,
                                                      "read": "abcd"}


def test_unfinished_bodies_past_the_ingress_slots_leave_the_app_serving_and_get_408(url, authed):
    """helper-75, through Serve's real proxy: more connections than the Ingress has slots, each
    declaring a 1000-byte body and sending 10 bytes, left /health and every request unanswered
    for as long as they stayed open. Now the app serves beside them, and each gets a 408 in the
    envelope once its body is late (BODY_READ_GRACE_S after its headers)."""
    import socket
    from urllib.parse import urlsplit

    from deployments.ingress import INGRESS_SPARE_SLOTS

    slots = authed.get("/v1/stats").json()["ingress"]["admission_limit"] + INGRESS_SPARE_SLOTS
    address = urlsplit(url)
    head = (f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":").encode()
    sockets = []
    try:
        for _ in range(slots + 12):
            sockets.append(socket.create_connection((address.hostname, address.port), timeout=60))
            sockets[-1].sendall(head)
        # before, neither answered while the slow connections stayed open (they stay open here)
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        fine = authed.post("/v1/images/generations", json={"prompt": "a circle", "seed": 1, "num_inference_steps": 2})
        assert fine.status_code == 200, fine.text
        for sock in sockets:
            answer = b""
            while b"}}" not in answer:
                chunk = sock.recv(65536)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"
    finally:
        for sock in sockets:
            sock.close()


def test_small_bodies_reach_the_ingress_in_the_scope_through_serve(ray_cluster):
    """Through Serve's real proxy (whose middlewares the test cluster installs): the body of a
    generation request arrives in the Ingress's scope, an upload-sized one through Serve's own
    path, both intact."""
    from ray import serve

    from deployments.proxy import BODY_IN_SCOPE_MAX_BYTES

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Echo:
        async def __call__(self, request: Request):
            return {"in_scope": request.scope.get(BODY_SCOPE_KEY) is not None, "read": len(await request.body())}

    serve.run(Echo.bind(), name="scope-probe", route_prefix="/scope-probe")
    try:
        url = f"{ray_cluster['url']}/scope-probe"
        small = httpx.post(url, json={"prompt": "a red circle"}, timeout=60).json()
        assert small == {"in_scope": True, "read": len(b'{"prompt":"a red circle"}')}
        big = httpx.post(url, content=b"x" * (BODY_IN_SCOPE_MAX_BYTES + 1), timeout=60).json()
        assert big == {"in_scope": False, "read": BODY_IN_SCOPE_MAX_BYTES + 1}
    finally:
        serve.delete("scope-probe")


def test_a_batch_key_defaults_its_requests_to_batch_priority():
    """``auth.batch_api_keys_*``: the key is accepted, and its requests that give no
    ``priority`` get ``batch`` (FastAPI app with ditserve's auth middleware, through HTTP)."""
    from fastapi.testclient import TestClient

    from deployments.http import BearerAuth, key_default_priority

    app = FastAPI()
    app.add_middleware(BearerAuth)
    app.state.api_keys = (KEY.encode(), b"sk-batch")
    app.state.batch_api_keys = (b"sk-batch",)

    @app.post("/v1/images/generations")
    async def echo(request: Request):
        return key_default_priority(await request.json(), request)

    client = TestClient(app)

    def sent(key: str, body: dict) -> dict:
        return client.post("/v1/images/generations", json=body, headers={"Authorization": f"Bearer {key}"}).json()

    assert sent("sk-batch", {"prompt": "a"}) == {"prompt": "a", "priority": "batch"}
    assert sent("sk-batch", {"prompt": "a", "priority": "interactive"})["priority"] == "interactive"
    assert sent("sk-batch", {"prompt": "a", "extra_body": {"priority": "interactive"}}) == {
        "prompt": "a", "extra_body": {"priority": "interactive"}}
    # null gives no priority, at the top level or in extra_body (it was taken as interactive)
    assert sent("sk-batch", {"prompt": "a", "priority": None})["priority"] == "batch"
    assert sent("sk-batch", {"prompt": "a", "extra_body": {"priority": None}}) == {
        "prompt": "a", "extra_body": {"priority": "batch"}}
    # a priority given in one place and null in the other is the one given (it became a 400 clash)
    both = {"prompt": "a", "priority": "interactive", "extra_body": {"priority": None}}
    assert sent("sk-batch", both) == both
    both = {"prompt": "a", "priority": None, "extra_body": {"priority": "interactive"}}
    assert sent("sk-batch", both) == both
    assert sent(KEY, {"prompt": "a"}) == {"prompt": "a"}  # an ordinary key: the route's default
    assert client.post("/v1/images/generations", json={"prompt": "a"},
                       headers={"Authorization": "Bearer sk-nope"}).status_code == 401
