"""The signature router through real Ray Serve with two CPU replicas."""

from __future__ import annotations

import base64
import json
import re
import socket
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from ray import serve

from compat.ray_serve import deploy_config
from deployments.faults import FAULT_ENV, STARTUP_FAULT_ENV
from pipeline.contract.images import ImageGenerationResponse
from pipeline.errors import RequestTimeoutError, ServiceUnavailableError
from tests.helpers import batches_running as running
from tests.helpers import metrics_samples, post, step_ms, steps_lasting, wait_until
from tests.helpers import router_stats as stats

pytestmark = pytest.mark.slow

TWO_REPLICAS = {
    "replica": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}, "torch_threads": 1},
    "batching": {"max_batch_size": 4, "max_wait_ms": 20, "max_affinity_wait_ms": 400,
                 "routing_stats_period_s": 0.2, "max_queued_requests": 64},
    "limits": {"max_pixels": 256 * 256},
}
FAST = {"size": "64x64", "num_inference_steps": 2}
SLOW = {"size": "256x256", "num_inference_steps": 60}  # about 3 s on one CPU thread
# about 5 s: holds the one replica while the queue behind it fills and a flood comes (the queued
# requests are FAST: they only have to wait, and then cost little)
LONG = {**SLOW, "num_inference_steps": 100}
# one replica with room for 2 queued requests: one app for the tests of overload and of
# cancellation (each compares the Router's counters as increases)
ONE_SMALL_QUEUE = {**TWO_REPLICAS, "replica": {**TWO_REPLICAS["replica"], "num_replicas": 1},
                   "batching": {**TWO_REPLICAS["batching"], "max_queued_requests": 2}}


def test_affinity_keeps_replicas_in_their_state(deploy):
    url = deploy(TWO_REPLICAS, fresh=True)  # replicas that have run nothing yet: no state to change from
    a = {"num_inference_steps": 2, "size": "64x64"}
    b = {"num_inference_steps": 3, "size": "64x64"}
    metas = []
    with ThreadPoolExecutor(4) as pool:
        for rnd in range(6):  # waves of alternating signatures
            bodies = [{"prompt": f"p{rnd}{i}", "seed": i, **(a if i % 2 else b)} for i in range(4)]
            metas += [r.json()["ditserve"] for r in pool.map(lambda body: post(url, body), bodies)]
    batches = {m["batch_id"]: m for m in metas}
    changes = sum(m["state_change"] for m in batches.values())
    assert changes <= 2, f"{changes} state changes over {len(batches)} batches"
    counters = stats(url)["counters"]
    assert counters.get("routing_hit", 0) > counters.get("routing_miss", 0)


def test_batches_are_signature_homogeneous_and_every_request_answered_once(deploy):
    url = deploy(TWO_REPLICAS)  # the test before's app, when it ran: its counters are compared as increases
    base = stats(url)["counters"].get("requests", 0)
    signatures = [{"num_inference_steps": 2}, {"num_inference_steps": 3}, {"num_inference_steps": 2, "size": "64x32"}]
    bodies = [{"prompt": f"shape {i}", "seed": i, **signatures[i % 3]} for i in range(24)]
    with ThreadPoolExecutor(24) as pool:
        responses = list(pool.map(lambda b: post(url, b), bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    metas = [r.json()["ditserve"] for r in responses]
    assert len({m["request_id"] for m in metas}) == 24
    by_batch = defaultdict(set)
    for m in metas:
        by_batch[m["batch_id"]].add(m["signature"])
    assert all(len(sigs) == 1 for sigs in by_batch.values())
    assert len(by_batch) < 24  # requests were batched
    for body, m in zip(bodies, metas, strict=True):  # each answer is its own request's
        assert m["seed"] == body["seed"]
    assert stats(url)["counters"]["requests"] - base >= 24
    # An emptied queue is dropped (kept, the Router would hold one per distinct float a client sent)
    assert stats(url)["queue_depth"] == {}


def test_a_burst_of_handle_calls_within_the_admission_limit_is_served(deploy):
    """60 handle calls sent at once from one driver, to an app admitting 72 (64 queued + a batch of
    4 per replica): each gets its image (28 got Serve's BackPressureError: the Ingress's
    max_queued_requests was 32, and Serve counts a handle's calls as queued until each is assigned)."""
    deploy(TWO_REPLICAS)
    handle = serve.get_app_handle("ditserve")
    calls = [handle.generate.remote({"prompt": f"burst {i}", "seed": i, **FAST}) for i in range(60)]
    answers = [call.result(timeout_s=300) for call in calls]
    assert [a.ditserve.seed for a in answers] == list(range(60))


def test_a_lone_request_on_an_idle_replica_does_not_wait_for_company(deploy):
    """``max_wait_ms`` of ten minutes: a lone request at an idle deployment is dispatched at
    once (it would otherwise time out at its 60 s deadline); a request that comes while a
    batch runs still waits for company (here: the full batch its followers make)."""
    lazy = {**TWO_REPLICAS, "replica": {**TWO_REPLICAS["replica"], "num_replicas": 1},
            "batching": {**TWO_REPLICAS["batching"], "max_wait_ms": 600_000, "max_batch_size": 3},
            "limits": {**TWO_REPLICAS["limits"], "max_n": 3}}
    url = deploy(lazy, fresh=True)
    alone = post(url, {"prompt": "alone", "seed": 1, "timeout_s": 60, **FAST})
    assert alone.status_code == 200 and alone.json()["ditserve"]["batch_size"] == 1
    time.sleep(0.5)  # idle again for longer than IDLE_GAP_S: the next lone request goes at once too
    with ThreadPoolExecutor(4) as pool:
        busy = pool.submit(post, url, {"prompt": "busy", "seed": 0, **SLOW})
        wait_until(lambda: stats(url)["inflight_batches"] == 1)
        followers = list(pool.map(lambda i: post(url, {"prompt": f"f{i}", "seed": i, "timeout_s": 120, **FAST}),
                                  range(3)))
        assert busy.result().status_code == 200
    assert [r.json()["ditserve"]["batch_size"] for r in followers] == [3, 3, 3]


def _dispatch_order(url, bodies: dict[str, dict], busy_body: dict = SLOW) -> list[str]:
    """Queue ``bodies`` (name -> body), in order, behind a running batch (``busy_body``) on the
    only replica; return their names in the order their batches were dispatched (batch ids
    count up)."""
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        busy = pool.submit(post, url, {"prompt": "busy", "seed": 0, **busy_body})
        wait_until(lambda: stats(url)["inflight_batches"] == 1)
        futures = {}
        for name, body in bodies.items():
            futures[name] = pool.submit(post, url, body)
            wait_until(lambda: stats(url)["queued"] == len(futures))
        answers = {name: f.result() for name, f in futures.items()}
        assert busy.result().status_code == 200
    assert all(r.status_code == 200 for r in answers.values()), [r.text for r in answers.values()]
    number = {name: int(r.json()["ditserve"]["batch_id"].split("-")[1]) for name, r in answers.items()}
    return sorted(number, key=number.get)


def test_interactive_work_goes_first_and_batch_work_has_a_starvation_bound(ray_cluster):
    """``priority: batch`` requests queued first still run after interactive ones (in one
    signature's queue and across queues); with a starvation bound of 0 (a ``user_config``
    update: the same replicas) they keep their turn. Batch work that is ready does not take the
    replica from interactive work still gathering company (a long ``max_wait_ms``: both queues
    wait past the running batch's end, the batch one, queued first, is ready first)."""
    one = {**TWO_REPLICAS, "replica": {**TWO_REPLICAS["replica"], "num_replicas": 1},
           "batching": {**TWO_REPLICAS["batching"], "max_batch_size": 1},
           "limits": {**TWO_REPLICAS["limits"], "max_n": 1}}
    other = {**FAST, "num_inference_steps": 3}  # another signature
    bodies = {"b1": {"prompt": "b1", "seed": 1, "priority": "batch", **FAST},
              "b2": {"prompt": "b2", "seed": 2, "priority": "batch", **FAST},
              "i1": {"prompt": "i1", "seed": 3, **FAST},
              "i2": {"prompt": "i2", "seed": 4, "priority": "interactive", **other}}
    if "ditserve" in serve.status().applications:  # start from nothing, as `serve deploy FILE` would
        serve.delete("ditserve")
    url = ray_cluster["url"]
    try:
        _deploy_config(one, one["batching"])
        assert _dispatch_order(url, bodies) == ["i1", "i2", "b1", "b2"]
        _deploy_config(one, {**one["batching"], "max_batch_priority_wait_ms": 0})
        wait_until(lambda: stats(url)["batching"]["max_batch_priority_wait_ms"] == 0, timeout=60)
        assert _dispatch_order(url, bodies) == ["b1", "b2", "i1", "i2"]
        gathering = {**one["batching"], "max_batch_size": 4, "max_wait_ms": 4000}
        _deploy_config(one, gathering)
        wait_until(lambda: stats(url)["batching"]["max_wait_ms"] == 4000, timeout=60)
        # about 0.9 s here (both queued 0.2 s in): it ends before either queue is ready
        shorter = {**SLOW, "size": "128x128"}
        assert _dispatch_order(url, {name: bodies[name] for name in ("b1", "i2")}, shorter) == ["i2", "b1"]
    finally:
        serve.delete("ditserve")  # the next test deploys afresh, also after a failure here


def test_a_starved_queue_waits_out_its_bound_then_goes_to_the_free_replica(deploy):
    """A switch priced above the starvation bound (affinity_switch_cost_ms 1000 > 400): a queue
    whose state the busy replica holds waits for it until the bound, then the free one takes it."""
    url = deploy({**TWO_REPLICAS, "batching": {**TWO_REPLICAS["batching"], "affinity_switch_cost_ms": 1000}},
                 fresh=True)
    with ThreadPoolExecutor(3) as pool:
        slow = pool.submit(post, url, {"prompt": "slow", "seed": 1, **SLOW})
        wait_until(lambda: stats(url)["inflight_batches"] == 1)
        fast = post(url, {"prompt": "fast", "seed": 2, **FAST}).json()["ditserve"]  # the other replica
        slow_replica = next(rid for rid, s in stats(url)["replicas"].items() if rid != fast["replica"])
        # Same signature as the running slow batch: it waits for that replica, then starves over.
        waiting = post(url, {"prompt": "slow too", "seed": 3, **SLOW}, timeout=300)
        assert waiting.status_code == 200
        meta = waiting.json()["ditserve"]
        assert slow.result().status_code == 200
    assert meta["timings_ms"]["queue"] >= 400 * 0.9
    assert meta["replica"] != slow_replica  # served by the free replica, not after the busy one
    assert stats(url)["counters"].get("routing_starvation", 0) >= 1


def test_overflow_is_429_without_touching_replicas(deploy):
    """The app holds max_queued_requests plus a full batch per replica (2 + 4 here), queued or
    running; a few more wait at the door (Serve's proxy queue) and the rest are refused at once
    with 429 + Retry-After in OpenAI's envelope, never reaching a replica."""
    url = deploy(ONE_SMALL_QUEUE)
    router = serve.get_deployment_handle("Router", "ditserve")  # the Ingress is full: ask the Router itself
    held = lambda: router.stats.remote().result()  # noqa: E731
    ran_before = held()["counters"].get("requests", 0)
    with ThreadPoolExecutor(48) as pool:
        running = pool.submit(post, url, {"prompt": "busy", "seed": 1, **LONG})
        wait_until(lambda: held()["inflight_batches"] == 1)
        queued = [pool.submit(post, url, {"prompt": f"q{i}", "seed": i, **FAST}) for i in range(5)]
        wait_until(lambda: held()["queued"] == 5)
        flood = list(pool.map(lambda i: post(url, {"prompt": f"f{i}", "seed": 100 + i, **FAST}, 600), range(40)))
        refused = [r for r in flood if r.status_code == 429]
        assert len(refused) >= 40 - 32, [r.status_code for r in flood]  # the door holds at most 32
        for r in refused:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "overloaded"
        assert {r.status_code for r in flood} <= {200, 429}
        assert all(f.result().status_code == 200 for f in [running, *queued])
    served = sum(r.status_code == 200 for r in flood)
    wait_until(lambda: held()["counters"].get("requests", 0) - ran_before == 6 + served)  # the refused never ran


def test_the_proxy_refuses_at_the_admission_limit_without_asking_the_ingress(deploy):
    """Every Ingress answer names the app's admission limit (2 queued + a batch of 4 = 6) and
    route prefix; once the proxy's AdmissionGate has seen it, requests beyond 6 in flight are
    refused in the proxy at once: none waits at Serve's door, none reaches the Router."""
    url = deploy(ONE_SMALL_QUEUE)
    first = httpx.get(f"{url}/v1/models", timeout=30)
    assert first.status_code == 200 and re.fullmatch(r"6; prefix=/; epoch=\d+", first.headers["x-ditserve-admission"])
    router = serve.get_deployment_handle("Router", "ditserve")
    held = lambda: router.stats.remote().result()  # noqa: E731
    before = held()["counters"]
    with ThreadPoolExecutor(24) as pool:
        running = pool.submit(post, url, {"prompt": "busy", "seed": 1, **LONG})
        wait_until(lambda: held()["inflight_batches"] == 1)
        queued = [pool.submit(post, url, {"prompt": f"q{i}", "seed": i, **FAST}) for i in range(5)]
        wait_until(lambda: held()["queued"] == 5)
        ingress = serve.get_app_handle("ditserve").stats.remote().result()["ingress"]
        assert ingress["waiting"] == 6  # handed to the Router, not yet answered (GET /v1/stats shows it)
        flood = list(pool.map(lambda i: post(url, {"prompt": f"f{i}", "seed": 100 + i, **FAST}, 60), range(12)))
        assert [r.status_code for r in flood] == [429] * 12  # at the limit: nobody waits at the door
        for r in flood:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # outside the API: Serve decides
        assert all(f.result().status_code == 200 for f in [running, *queued])
    assert post(url, {"prompt": "after", "seed": 9, **FAST}).status_code == 200  # room again
    counters = held()["counters"]
    assert counters.get("requests", 0) - before.get("requests", 0) == 7
    assert counters.get("rejected_overloaded", 0) == before.get("rejected_overloaded", 0)
    # the proxy counts its refusals (they never reach the Router): an operator saw no overload at all
    refused = lambda samples: sum(float(s.rsplit(" ", 1)[1]) for s in samples if 'route_prefix="/"' in s)  # noqa: E731
    samples = metrics_samples("ray_ditserve_admission_refusals_total", until=lambda s: refused(s) >= 12)
    assert refused(samples) >= 12, samples


def test_a_batch_priority_backlog_leaves_interactive_work_room(deploy):
    """Priority 'batch' requests may fill max_queued_batch_requests of the queue (by default
    three quarters of max_queued_requests 2: 1), so their backlog does not refuse interactive
    work: with the replica busy and a batch request queued, the next batch request is 429
    naming the knob, an interactive one is still taken; beyond the whole queue both are 429."""
    url = deploy(ONE_SMALL_QUEUE)
    router = serve.get_deployment_handle("Router", "ditserve")
    held = lambda: router.stats.remote().result()  # noqa: E731
    before = held()["counters"]
    # the limit in force, resolved from its default (it showed the configured null: helper-42)
    assert stats(url)["batching"]["max_queued_batch_requests"] == 1
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(post, url, {"prompt": "busy", "seed": 1, **LONG})]
        wait_until(lambda: held()["inflight_batches"] == 1)
        # held: 1 running + 4 queued = 5, the admission limit 6 less the place kept for interactive work
        queued = [pool.submit(post, url, {"prompt": f"b{i}", "seed": i, "priority": "batch", **FAST})
                  for i in range(4)]
        wait_until(lambda: held()["queued"] == 4)
        refused = post(url, {"prompt": "b4", "seed": 4, "priority": "batch", **FAST})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "overloaded" and "max_queued_batch_requests 1 " in error["message"]
        queued.append(pool.submit(post, url, {"prompt": "i0", "seed": 5, **FAST}))  # interactive: room kept
        wait_until(lambda: held()["queued"] == 5)
        assert held()["queued_by_priority"] == {"interactive": 1, "batch": 4}
        for priority in ("interactive", "batch"):  # the whole queue is full now
            assert post(url, {"prompt": "late", "seed": 6, "priority": priority, **FAST}).status_code == 429
        assert [f.result().status_code for f in [*running, *queued]] == [200] * 6
    assert held()["queued_by_priority"] == {"interactive": 0, "batch": 0}
    counters = held()["counters"]
    assert counters.get("rejected_overloaded", 0) - before.get("rejected_overloaded", 0) >= 1  # the proxy's gate may refuse the last two


def test_handle_cancel_and_deadline_remove_queued_requests(deploy):
    url = deploy(ONE_SMALL_QUEUE)  # at most one request queued at a time here
    before = stats(url)["counters"]
    increase = lambda name: stats(url)["counters"].get(name, 0) - before.get(name, 0)  # noqa: E731
    handle = serve.get_app_handle("ditserve")
    # LONG (~6 s here): it must outlast a 1 s read timeout and two 0.3 s deadlines with the polls
    # between them (1.9 s here); SLOW (3.6 s) left a margin under 2x
    busy = handle.generate.remote({"prompt": "busy", "seed": 1, **LONG})
    wait_until(lambda: stats(url)["inflight_batches"] == 1)
    doomed = handle.generate.remote({"prompt": "cancel me", "seed": 2, **FAST})
    wait_until(lambda: stats(url)["queued"] == 1)
    doomed.cancel()
    wait_until(lambda: stats(url)["queued"] == 0)
    with pytest.raises(httpx.ReadTimeout):  # an HTTP client that hangs up leaves the queue too
        post(url, {"prompt": "gone", "seed": 4, **FAST}, timeout=1.0)
    wait_until(lambda: increase("cancelled") == 2)
    assert stats(url)["queued"] == 0
    with pytest.raises(RequestTimeoutError) as info:
        handle.generate.remote({"prompt": "too late", "seed": 3, "timeout_s": 0.3, **FAST}).result()
    assert info.value.status_code == 504
    r = post(url, {"prompt": "too late", "seed": 3, "timeout_s": 0.3, **FAST})
    assert r.status_code == 504 and r.json()["error"]["param"] == "timeout_s"
    busy.result()
    assert increase("cancelled") == 2 and increase("rejected_timeout") == 2
    assert increase("requests") == 1  # only the busy request ever ran


def test_clients_that_stop_reading_hold_no_room(deploy):
    """Clients that send a request and never read its answer (~1 MB of JSON: 4 images of
    256x256; or a stream of 2 previews and the image, ~0.8 MB) nor hang up cost the app nothing
    once their requests ran: more of them than the app's admission limit (6), and then the
    limit's worth of requests at once is served, none refused; the Ingress waits for none of
    them (``/v1/stats`` ``ingress.waiting``)."""
    url = deploy(ONE_SMALL_QUEUE)
    before = stats(url)["counters"].get("requests", 0)
    port = int(url.rsplit(":", 1)[1])
    image = {"prompt": "never read", "size": "256x256", "num_inference_steps": 3}
    bodies = [json.dumps({**image, "n": 4}).encode(),
              json.dumps({**image, "stream": True, "partial_images": 2}).encode()]
    silent = []
    try:
        for i in range(8):
            body = bodies[i % 2]
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the rest waits here
            client.connect(("127.0.0.1", port))
            client.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: ditserve\r\n"
                           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            silent.append(client)
            wait_until(lambda i=i: stats(url)["counters"].get("requests", 0) - before == i + 1)
        assert httpx.get(f"{url}/v1/stats", timeout=30).json()["ingress"]["waiting"] == 0
        with ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(lambda i: post(url, {"prompt": f"r{i}", "seed": i, **FAST}).status_code, range(6)))
        assert codes == [200] * 6
    finally:
        for client in silent:
            client.close()


def test_failing_signature_answers_each_request_while_others_flow(deploy):
    args = {**TWO_REPLICAS}
    args["replica"] = {**TWO_REPLICAS["replica"],
                       "ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": {FAULT_ENV: "steps=3 "}}}}
    url = deploy(args, fresh=True)
    bodies = [{"prompt": f"p{i}", "seed": i, "num_inference_steps": 3 if i % 2 else 2} for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda b: post(url, b), bodies))
    for body, r in zip(bodies, responses, strict=True):
        if body["num_inference_steps"] == 3:
            assert r.status_code == 500
            error = r.json()["error"]
            assert "request img-" in error["message"] and "Traceback" not in error["message"]
        else:
            assert r.status_code == 200
    assert post(url, {"prompt": "after", "seed": 1, "num_inference_steps": 2}).status_code == 200
    assert stats(url)["counters"]["failed_batches"] >= 1


def _outcomes_of_a_delete(responses, images: list | None = None) -> list[str]:
    """Delete the app and wait for each response: ``"image"`` (its response appended to
    ``images``), or ``"503"`` (the Router's answer for work no replica ran: its app is being
    deleted). Anything else fails."""
    deleting = threading.Thread(target=serve.delete, args=("ditserve",))
    deleting.start()
    outcomes = []
    for response in responses:
        try:
            result = response.result(timeout_s=120)
        except ServiceUnavailableError as exc:
            assert exc.status_code == 503 and exc.code == "unavailable", exc.to_envelope()
            assert exc.to_envelope()["error"]["type"] == "server_error"
            assert "its app is being deleted" in exc.to_envelope()["error"]["message"], exc.to_envelope()
            outcomes.append("503")
        else:
            assert isinstance(result, ImageGenerationResponse) and len(result.data) == 1
            assert base64.b64decode(result.data[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n"
            outcomes.append("image")
            if images is not None:
                images.append(result)
    deleting.join(timeout=120)
    return outcomes


def test_shutdown_answers_every_queued_request(deploy):
    """Each request accepted before the app is deleted gets exactly one answer: the running
    batch's image, and for the queued ones a 503 in OpenAI's envelope, from the Router once it
    sees its app deleting (not when its graceful shutdown times out, 95 s later). The running
    batch outlasts the callers' lease (5 s, which nobody can renew with a Router that Serve has
    stopped routing to): it still finishes (CI's slower machine once turned it into a 503).
    The queued requests wait for the busy replica that holds their state while the other one
    is free: when the delete empties the replica set, the Router must not send them off blind
    (such a batch waited in the handle for a replica that never came, until the Ingress
    answered "router unavailable")."""
    url = deploy({**TWO_REPLICAS, "replica": {**TWO_REPLICAS["replica"], "graceful_shutdown_timeout_s": 90},
                  "batching": {**TWO_REPLICAS["batching"], "affinity_switch_cost_ms": 60_000,
                               "max_affinity_wait_ms": 60_000},
                  "limits": {**TWO_REPLICAS["limits"], "max_steps": 1000}}, fresh=True)
    handle = serve.get_app_handle("ditserve")
    # The busy batch lasts ~10 s on any machine, twice the lease: its steps come from a measured
    # 20-step batch (a fixed 180 steps took ~9 s here, would have ended within the lease on a
    # machine 2x faster, and a grace of 30 s killed it on a slowed CI machine)
    per_step = step_ms(lambda steps: handle.generate.remote({"prompt": "measure", "seed": 0, **SLOW,
                                                            "num_inference_steps": steps}
                                                           ).result(timeout_s=120).ditserve.timings_ms["denoise"], 20)
    slow = {**SLOW, "num_inference_steps": steps_lasting(10.0, per_step, 20, 1000)}
    busy = handle.generate.remote({"prompt": "busy", "seed": 0, **slow})
    wait_until(lambda: running(url, 1))  # begun on its replica (a batch still on its way there dies with it)
    responses = [handle.generate.remote({"prompt": f"p{i}", "seed": i, **slow}) for i in range(6)]
    wait_until(lambda: stats(url)["queued"] == 6)
    images = []
    outcomes = _outcomes_of_a_delete([busy, *responses], images)
    assert outcomes[0] == "image"  # the running batch finishes
    # the premise (not a speed target): it outlasted the callers' lease
    assert images[0].ditserve.timings_ms["denoise"] > 5000.0
    assert outcomes[1:] == ["503"] * 6, outcomes  # queued, never run: every one answered 503


def test_a_batch_its_replica_stops_past_the_grace_at_shutdown_is_a_503_not_a_500(deploy):
    """A batch still running when its replica's ``graceful_shutdown_timeout_s`` passes during
    a delete is killed with the replica: its requests were answered 500 ``batch_failed`` (a
    slowed CI machine met it when ``ditserve serve`` was stopped), where the server is shutting
    down: a 503 ``unavailable`` saying so, counted ``rejected_app_deleted``."""
    url = deploy({**TWO_REPLICAS, "replica": {**TWO_REPLICAS["replica"], "num_replicas": 1,
                                              "graceful_shutdown_timeout_s": 1},
                  "limits": {**TWO_REPLICAS["limits"], "max_steps": 400}}, fresh=True)
    handle = serve.get_app_handle("ditserve")
    killed = handle.generate.remote({"prompt": "killed", "seed": 0, **SLOW, "num_inference_steps": 400})  # ~20 s
    wait_until(lambda: running(url, 1))
    deleting = threading.Thread(target=serve.delete, args=("ditserve",))
    deleting.start()
    with pytest.raises(ServiceUnavailableError) as info:
        killed.result(timeout_s=120)
    deleting.join(timeout=120)
    assert info.value.status_code == 503 and info.value.code == "unavailable", info.value.to_envelope()
    assert "stopped while it ran" in info.value.message and "graceful_shutdown_timeout_s" in info.value.message


def test_shutdown_without_affinity_answers_every_request_once(deploy):
    """With Serve's default request router (affinity off) the Router watches the replica set
    too: a batch that ends after the delete leaves the queued work held and answered 503, or
    (ending before the delete reached the handle) run; never left waiting in the handle for
    a replica that is not coming."""
    url = deploy({**TWO_REPLICAS, "replica": {**TWO_REPLICAS["replica"], "graceful_shutdown_timeout_s": 90},
                  "batching": {**TWO_REPLICAS["batching"], "affinity": False},
                  "limits": {**TWO_REPLICAS["limits"], "max_steps": 200}}, fresh=True)
    handle = serve.get_app_handle("ditserve")
    long = handle.generate.remote({"prompt": "long", "seed": 0, **SLOW, "num_inference_steps": 180})  # ~9 s
    wait_until(lambda: running(url, 1))
    short = handle.generate.remote({"prompt": "short", "seed": 1, **SLOW, "num_inference_steps": 20})  # ~1 s
    wait_until(lambda: running(url, 2))
    responses = [handle.generate.remote({"prompt": f"p{i}", "seed": i, **FAST}) for i in range(6)]
    wait_until(lambda: stats(url)["queued"] == 6)
    outcomes = _outcomes_of_a_delete([long, short, *responses])
    assert outcomes[:2] == ["image", "image"], outcomes  # the running batches finish; the rest: images or 503s


def _deploy_config(args: dict, router_user_config: dict, deployments: tuple = (), running: bool = True) -> None:
    """Deploy as a Serve config file is deployed (serve deploy / serve run FILE / RayService),
    with the Router's batching knobs (and ``deployments``' entries; a Router one adds to its
    entry) in the file's ``deployments`` section; with ``running``, wait until the app runs."""
    from ray.serve.schema import ServeDeploySchema

    router = {"name": "Router", "user_config": router_user_config}
    for entry in deployments:
        if entry["name"] == "Router":
            router.update(entry)
    config = ServeDeploySchema.model_validate({"applications": [
        {"name": "ditserve", "route_prefix": "/", "import_path": "deployments.app:build_app", "args": args,
         "deployments": [router, *(e for e in deployments if e["name"] != "Router")]}]})
    deploy_config(config, wait_running=False)
    if running:
        wait_until(lambda: serve.status().applications["ditserve"].status == "RUNNING", timeout=120)


def test_user_config_changes_batching_without_a_restart(ray_cluster):
    """A config file's Router ``user_config`` changes the batching knobs live (no replica
    restarted), and with them the admission limit the Ingress names for the proxy's gate: up to
    what the Ingress takes (its ``max_ongoing_requests`` less 4 spare slots), then, once the file
    raises that too (a live update as well), the Router's whole limit; a DiTReplica count the
    file's ``deployments`` section raises counts too (args said 1: the limit stayed at 1's)."""
    one = {**TWO_REPLICAS, "replica": {**TWO_REPLICAS["replica"], "num_replicas": 1},
           "acceleration": {"cfg_gate_step": 0.5}}
    small = {**one, "batching": {**one["batching"], "max_batch_size": 1, "max_batch_cost": 64 * 64}}
    if "ditserve" in serve.status().applications:  # start from nothing, as `serve deploy FILE` would
        serve.delete("ditserve")
    url = ray_cluster["url"]
    try:
        # the Ingress's first user_config names adapters only: args' acceleration defaults stand
        _deploy_config(one, small["batching"], ({"name": "Ingress", "user_config": {"loras": {}}},))
        before = stats(url)
        assert before["max_batch_size"] == 1
        admission = lambda: serve.get_app_handle("ditserve").stats.remote().result()["ingress"]  # noqa: E731
        wait_until(lambda: admission()["admission_limit"] == 64 + 1)  # the Router's: 64 queued + a batch of 1
        assert {k: before["batching"][k] for k in small["batching"]} == small["batching"]  # the file's knobs
        with ThreadPoolExecutor(6) as pool:
            metas = [r.json()["ditserve"] for r in pool.map(lambda i: post(url, {"prompt": f"p{i}", "seed": i, **FAST}),
                                                           range(6))]
        assert max(m["batch_size"] for m in metas) == 1
        assert {m["acceleration"]["cfg_gate"]["gate_step"] for m in metas} == {0.5}  # it was 1.0
        # a request larger than a whole batch ran as an oversized batch of 2 (helper-28's review)
        over = post(url, {"prompt": "two", "seed": 1, "n": 2, **FAST})
        assert over.status_code == 400 and over.json()["error"]["param"] == "n", over.text
        assert "batching.max_batch_size is 1" in over.json()["error"]["message"]
        # and one past max_batch_cost (pixels x frames x n): a 128x128 image is 4 batches' worth
        wide = post(url, {"prompt": "wide", "seed": 1, **FAST, "size": "128x128"})
        assert wide.status_code == 400 and wide.json()["error"]["param"] == "size", wide.text
        assert "batching.max_batch_cost 4096" in wide.json()["error"]["message"]
        assert stats(url)["counters"]["rejected_exceeds_batch"] == 2
        ingress_replica = admission()["replica"]
        replicas_before = set(stats(url)["replicas"])
        _deploy_config(one, {**one["batching"], "max_batch_size": 8})  # args unchanged: a user_config update
        wait_until(lambda: stats(url)["max_batch_size"] == 8, timeout=60)
        # the Router admits 64 + 8, the Ingress takes 68 + 4 (sized from args: 64 + a batch of 4)
        wait_until(lambda: admission()["admission_limit"] == 68)
        _deploy_config(one, {**one["batching"], "max_batch_size": 8},
                       ({"name": "Ingress", "max_ongoing_requests": 72 + 4},))
        wait_until(lambda: admission()["admission_limit"] == 72, timeout=60)
        assert admission()["replica"] == ingress_replica  # a live update too
        assert re.fullmatch(r"72; prefix=/; epoch=\d+", httpx.get(f"{url}/v1/models").headers["x-ditserve-admission"])
        after = stats(url)
        assert after["router_replica"] == before["router_replica"] and after["max_batch_size"] == 8
        with ThreadPoolExecutor(8) as pool:
            busy = pool.submit(post, url, {"prompt": "busy", "seed": 0, **SLOW})
            wait_until(lambda: stats(url)["inflight_batches"] == 1)
            metas = [r.json()["ditserve"] for r in pool.map(lambda i: post(url, {"prompt": f"q{i}", "seed": i, **FAST}),
                                                              range(6))]
            busy.result()
        assert max(m["batch_size"] for m in metas) > 1
        assert {m["replica"] for m in metas} <= replicas_before  # the DiTReplica was not restarted either
        # a second DiTReplica from the file's deployments section (args still say 1): 64 + 8 per replica
        _deploy_config(one, {**one["batching"], "max_batch_size": 8},
                       ({"name": "Ingress", "max_ongoing_requests": 80 + 4}, {"name": "DiTReplica", "num_replicas": 2}))
        wait_until(lambda: admission()["admission_limit"] == 80, timeout=60)
        # an update naming some knobs keeps args' values for the others (they took the defaults:
        # a max_wait_ms-only update ran max_batch_size 8 where args said 4; an Ingress update of
        # attention_backend alone dropped args' cfg_gate_step)
        _deploy_config(one, {"max_wait_ms": 15},
                       ({"name": "Ingress", "max_ongoing_requests": 80 + 4,
                         "user_config": {"acceleration": {"attention_backend": "torch_sdpa"}}},
                        {"name": "DiTReplica", "num_replicas": 2}))
        wait_until(lambda: stats(url)["batching"]["max_wait_ms"] == 15, timeout=60)
        assert {k: stats(url)["batching"][k] for k in ("max_batch_size", "max_queued_requests")} == {
            "max_batch_size": 4, "max_queued_requests": 64}
        gated = lambda: post(url, {"prompt": "gated", "seed": 1, **FAST}).json()["ditserve"]  # noqa: E731
        wait_until(lambda: gated()["acceleration"]["attention_backend"] == "torch_sdpa", timeout=60)
        assert gated()["acceleration"]["cfg_gate"]["gate_step"] == 0.5  # args' default, kept
        # a max_batch_cost no request giving a prompt alone fits (64x64: 4096) is refused, the knobs
        # in force kept (helper-76: it answered every such request 400)
        _deploy_config(one, {"max_wait_ms": 15, "max_batch_cost": 4095},
                       ({"name": "Ingress", "max_ongoing_requests": 80 + 4,
                         "user_config": {"acceleration": {"attention_backend": "torch_sdpa"}}},
                        {"name": "DiTReplica", "num_replicas": 2}))
        refused = lambda: serve.get_app_handle("ditserve").stats.remote().result()["router"][  # noqa: E731
            "live_update_refused"]
        wait_until(lambda: refused() is not None, timeout=60)
        assert "batching.max_batch_cost 4095 < 4096" in refused()["error"], refused()
        assert stats(url)["batching"]["max_batch_cost"] is None
        assert post(url, {"prompt": "fits", "seed": 1, **FAST}).status_code == 200
        # past max_batch_cost by n alone, the refusal names n and the n that fits; by size, size
        # (helper-79: n=3 at the default size was told param 'size')
        _deploy_config(one, {"max_wait_ms": 15, "max_batch_cost": 2 * 64 * 64},
                       ({"name": "Ingress", "max_ongoing_requests": 80 + 4,
                         "user_config": {"acceleration": {"attention_backend": "torch_sdpa"}}},
                        {"name": "DiTReplica", "num_replicas": 2}))
        wait_until(lambda: stats(url)["batching"]["max_batch_cost"] == 2 * 64 * 64, timeout=60)
        many = post(url, {"prompt": "many", "seed": 1, "n": 3, **FAST}).json()["error"]
        assert many["param"] == "n" and "ask for n at most 2" in many["message"], many
        wide = post(url, {"prompt": "wide", "seed": 1, **FAST, "size": "128x128"}).json()["error"]
        assert wide["param"] == "size" and "a smaller size" in wide["message"], wide
    finally:
        serve.delete("ditserve")  # the next test deploys afresh, also after a failure here


def test_a_config_giving_the_router_a_second_replica_is_refused_and_a_running_one_serves_on(ray_cluster):
    """A Serve config file whose ``deployments`` section gives the Router 2 replicas (which
    ``bind_app``, and so ``ditserve serve --check``, never sees when Serve deploys the file): each
    Router replica refuses to start naming the fix, so a fresh deploy is DEPLOY_FAILED; a live
    ``serve deploy`` onto a running app leaves the running Router serving alone (its queues and
    video jobs: a second Router took half the requests, and their video jobs 404ed on the
    first) while Serve retries the second and reports why in the Router's status message."""
    one = {**TWO_REPLICAS, "replica": {**TWO_REPLICAS["replica"], "num_replicas": 1}}
    if "ditserve" in serve.status().applications:  # start from nothing, as `serve deploy FILE` would
        serve.delete("ditserve")
    url = ray_cluster["url"]
    two_routers = ({"name": "Router", "num_replicas": 2},)

    def router_status():  # a blank one while the app is still being built
        from ray.serve.schema import DeploymentStatusOverview

        app = serve.status().applications.get("ditserve")
        return (app.deployments.get("Router") if app else None) or DeploymentStatusOverview(
            status="UPDATING", status_trigger="UNSPECIFIED", replica_states={}, message="")

    try:
        _deploy_config(one, one["batching"], two_routers, running=False)
        wait_until(lambda: router_status().status == "DEPLOY_FAILED", timeout=120)
        assert "runs as one replica" in router_status().message and "asks for 2" in router_status().message
        serve.delete("ditserve")
        _deploy_config(one, one["batching"])
        router = stats(url)["router_replica"]
        _deploy_config(one, one["batching"], two_routers, running=False)
        wait_until(lambda: "runs as one replica" in router_status().message, timeout=120)
        for seed in range(4):
            r = post(url, {"prompt": "after", "seed": seed, **FAST})
            assert r.status_code == 200, r.text
        assert stats(url)["router_replica"] == router
        assert router_status().replica_states.get("RUNNING") == 1
    finally:
        serve.delete("ditserve")


def test_a_redeploy_whose_replicas_fail_to_start_answers_503_at_once(ray_cluster):
    """A config redeploy that changes only DiTReplica (its actor options) to a version whose
    constructor fails: Serve stops the old replica and gives up on the new one (DEPLOY_FAILED)
    while the Router and Ingress stay. The request queued meanwhile and every new one are
    answered 503 within seconds (they waited for their client's timeout before, for ever
    without one); a fixed redeploy serves again."""
    one = {**TWO_REPLICAS, "replica": {**TWO_REPLICAS["replica"], "num_replicas": 1,
                                       "max_constructor_retry_count": 1}}  # Serve gives up on the first failure
    if "ditserve" in serve.status().applications:  # start from nothing, as `serve deploy FILE` would
        serve.delete("ditserve")
    url = ray_cluster["url"]
    broken = {"name": "DiTReplica", "ray_actor_options": {"num_cpus": 1, "runtime_env": {
        "env_vars": {STARTUP_FAULT_ENV: "a checkpoint that no longer loads"}}}}
    try:
        _deploy_config(one, one["batching"])
        router = stats(url)["router_replica"]
        with ThreadPoolExecutor(2) as pool:
            busy = pool.submit(post, url, {"prompt": "running", "seed": 1, **SLOW})
            wait_until(lambda: stats(url)["inflight_batches"] == 1)
            _deploy_config(one, one["batching"], [broken], running=False)
            queued = pool.submit(post, url, {"prompt": "queued", "seed": 2, **FAST})  # while it is replaced
            wait_until(lambda: serve.status().applications["ditserve"].deployments["DiTReplica"].status
                       == "DEPLOY_FAILED", timeout=120)
            answers = [queued.result(timeout=30), post(url, {"prompt": "new", "seed": 3, **FAST}, timeout=30)]
            busy.result(timeout=120)  # the old replica finished its batch or its callers got an answer
        for r in answers:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "unavailable" and "failed to deploy" in r.json()["error"]["message"]
            assert "Traceback" not in r.text and STARTUP_FAULT_ENV not in r.text
        after = stats(url)
        assert after["router_replica"] == router and after["counters"]["rejected_deploy_failed"] >= 2
        _deploy_config(one, one["batching"], [{**broken, "ray_actor_options": {"num_cpus": 1}}])
        assert post(url, {"prompt": "fixed", "seed": 4, **FAST}).status_code == 200
        # a redeploy that changes args replaces the Router (and Ingress) too: the new Router never
        # saw a replica, and still answers 503 instead of waiting for one (or failing the batch 500)
        changed = {**one, "batching": {**one["batching"], "max_wait_ms": one["batching"].get("max_wait_ms", 10) + 1}}
        _deploy_config(changed, one["batching"], [broken], running=False)

        def new_router() -> bool:
            try:
                return stats(url)["router_replica"] != router
            except Exception:  # the Ingress is being replaced
                return False

        wait_until(new_router, timeout=120)
        with ThreadPoolExecutor(1) as pool:  # (most likely) while the new DiTReplica still tries to start:
            early = pool.submit(post, url, {"prompt": "early", "seed": 5, **FAST}, 120)  # waits for a replica
            wait_until(lambda: serve.status().applications["ditserve"].status == "DEPLOY_FAILED", timeout=120)
            answers = [early.result(timeout=30), post(url, {"prompt": "late", "seed": 6, **FAST}, timeout=30)]
        for r in answers:
            assert r.status_code == 503 and "failed to deploy" in r.json()["error"]["message"], r.text
        replaced = stats(url)
        assert replaced["router_replica"] != router and replaced["counters"]["rejected_deploy_failed"] >= 1
        assert not replaced["counters"].get("failed_batches") and not replaced["counters"].get("rejected_batch_failed")
    finally:
        serve.delete("ditserve")
