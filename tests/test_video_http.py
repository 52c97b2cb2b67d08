"""Video jobs over HTTP (OpenAI's client and plain JSON) and the handle, on the embedded tiny Wan.

Real Ray Serve, real FFmpeg (PyAV) on both ends: the MP4 that comes back is decoded and its
frame count and size checked.
"""

from __future__ import annotations

import io
import time

import httpx
import pytest
from PIL import Image

from deployments.jobs import JobStatus, JobStore, VideoJobs
from deployments.faults import FAULT_ENV
from pipeline.media import decode_mp4
from pipeline.errors import InvalidRequestError, NotFoundError
from pipeline.modes import GuidanceMode
from pipeline.sampling import SamplingParams
from tests.helpers import openai_client

pytestmark = pytest.mark.slow

# tiny-wan: 1 replica x 2 threads; the fault injection fails any batch at 7 steps.
WAN_ARGS = {
    "model": {"name": "tiny-wan"},
    "limits": {"default_size": "64x48", "default_steps": 6, "default_guidance_scale": 4.0,
               "default_num_frames": 9, "default_fps": 8, "max_frames": 17, "max_pixels": 96 * 96},
    "replica": {"num_replicas": 1, "torch_threads": 2,
                "ray_actor_options": {"num_cpus": 2, "runtime_env": {"env_vars": {FAULT_ENV: "steps=7 "}}}},
}


@pytest.fixture(scope="module")
def url(deploy):
    return deploy(WAN_ARGS)


def poll(url, video_id, timeout_s=120):
    """Retrieve the job until it finishes; returns (final job, progress values seen)."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/videos/{video_id}", timeout=30).json()
        seen.append(job["progress"])
        if job["status"] in ("completed", "failed"):
            return job, seen
        time.sleep(0.05)
    raise AssertionError(f"job {video_id} did not finish: {job}")


def test_a_running_job_shows_its_latest_preview_frame_as_its_thumbnail(url):
    """videos.previews (2 by default): a running job decodes the first frame of its current
    prediction at evenly spaced steps, served as OpenAI's ``thumbnail`` variant until it completes."""
    created = httpx.post(f"{url}/v1/videos", json={"prompt": "a red circle", "seed": 5, "size": "64x48",
                                                   "num_inference_steps": 60}, timeout=30).json()  # ~3 s
    early = httpx.get(f"{url}/v1/videos/{created['id']}/content", params={"variant": "thumbnail"}, timeout=30)
    previews, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/v1/videos/{created['id']}/content", params={"variant": "thumbnail"}, timeout=30)
        job = httpx.get(f"{url}/v1/videos/{created['id']}", timeout=30).json()  # after: the frame was a preview
        if job["status"] in ("completed", "failed"):
            break
        if job["status"] == "in_progress" and r.status_code == 200:
            previews.append((job["progress"], r.content))
        time.sleep(0.05)
    assert job["status"] == "completed", job
    assert early.status_code == 400 and early.json()["error"]["code"] == "video_not_ready"  # none decoded yet
    assert previews and all(0 < progress < 100 for progress, _ in previews)
    # the latest, not the first kept (helper-71): the first preview, then the second in its place for good
    shown = [content for i, (_, content) in enumerate(previews) if i == 0 or content != previews[i - 1][1]]
    assert len(shown) == 2 and shown[0] != shown[1]
    for content in shown:
        frame = Image.open(io.BytesIO(content))
        assert frame.format == "WEBP" and frame.size == (64, 48)


def test_openai_client_creates_polls_and_downloads_an_mp4(url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    job = client.videos.create(model="tiny-wan", prompt="a red circle on a blue background", seconds="1",
                               size="64x48", extra_body={"seed": 3, "fps": 8, "num_inference_steps": 12})
    assert job.object == "video" and job.status in ("queued", "in_progress") and job.id.startswith("video_")
    statuses, progress = [], []
    while job.status not in ("completed", "failed"):
        job = client.videos.retrieve(job.id)
        statuses.append(job.status)
        progress.append(job.progress)
        time.sleep(0.02)
    assert job.status == "completed", job.error
    assert progress == sorted(progress) and progress[-1] == 100  # monotonic, ends at 100
    assert any(0 < p < 100 for p in progress) or "in_progress" in statuses
    data = client.videos.download_content(job.id).read()
    frames, fps = decode_mp4(data)
    assert frames.shape == (9, 48, 64, 3) and fps == 8  # 1 s at 8 fps -> 4·round(8/4) + 1 frames
    assert job.seconds == "1.125" and job.size == "64x48" and job.prompt == "a red circle on a blue background"
    # OpenAI's thumbnail variant: the first frame (both encodings are lossy: compared loosely)
    import numpy as np

    thumbnail = Image.open(io.BytesIO(client.videos.download_content(job.id, variant="thumbnail").read()))
    assert thumbnail.format == "WEBP" and thumbnail.size == (64, 48)
    assert np.abs(np.asarray(thumbnail.convert("RGB"), dtype=float) - frames[0]).mean() < 8
    refused = httpx.get(f"{url}/v1/videos/{job.id}/content", params={"variant": "spritesheet"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "variant"


def test_json_request_with_num_frames_and_same_seed_same_video(url):
    """The same request run twice, each alone in its batch: the same MP4, byte for byte.

    Run one after the other on purpose: posted back to back, which batches they land in depends
    on timing (CI failed once on their bytes that way), and a request's frames in a batch of 2
    differ from alone by float rounding (measured 2e-6 in [0, 1]; ``tests/test_wan.py`` bounds it at
    1e-4), enough to flip an 8-bit level and change the MP4's bytes."""
    body = {"prompt": "a green star", "num_frames": 5, "seed": 11, "size": "32x32"}
    jobs = []
    for _ in range(2):
        created = httpx.post(f"{url}/v1/videos", json=body, timeout=30).json()
        jobs.append(poll(url, created["id"])[0])
    a, b = jobs
    assert a["status"] == b["status"] == "completed"
    assert a["ditserve"]["num_frames"] == 5 and a["ditserve"]["seed"] == 11
    content = [httpx.get(f"{url}/v1/videos/{j['id']}/content", timeout=30) for j in (a, b)]
    assert all(r.status_code == 200 and r.headers["content-type"] == "video/mp4" for r in content)
    frames, _ = decode_mp4(content[0].content)
    assert frames.shape == (5, 32, 32, 3)
    sizes = [j["ditserve"]["batch_size"] for j in (a, b)]
    assert sizes == [1, 1], sizes  # each ran alone (nothing else is in flight in this module)
    assert content[0].content == content[1].content  # same seed, same batch composition: same bytes


def test_handle_submit_status_content(url):
    from ray import serve

    handle = serve.get_app_handle("ditserve")
    job = handle.submit_video.remote({"prompt": "a yellow ring", "num_frames": 5, "seed": 2}).result()
    for _ in range(600):
        job = handle.video_status.remote(job.id).result()
        if job.status in ("completed", "failed"):
            break
        time.sleep(0.05)
    assert job.status == "completed" and job.progress == 100
    frames, _ = decode_mp4(handle.video_content.remote(job.id).result())
    assert frames.shape[0] == 5


def test_an_idempotency_key_makes_one_job_however_often_the_create_is_sent(url):
    """A create sent again after its answer was lost (a client timeout and the SDK's retry, a
    Ctrl-C) made a second job that ran unseen (helper-29's review). With OpenAI's and Stripe's
    ``Idempotency-Key`` the same request returns the job the key made while it is kept; the key
    with another request is a 400; keys are per caller; a deleted job's key makes no new job."""
    from ray import serve

    body = {"prompt": "once", "num_frames": 5, "num_inference_steps": 2, "size": "32x32", "seed": 1}
    send = lambda b, key, auth="": httpx.post(f"{url}/v1/videos", json=b, timeout=30,  # noqa: E731
                                              headers={"Idempotency-Key": key, "Authorization": auth})
    first = send(body, "k-1").json()
    assert send(body, "k-1").json()["id"] == first["id"]  # the same job, not a second one
    other = send({**body, "prompt": "another"}, "k-1")
    assert other.status_code == 400 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert other.json()["error"]["param"] == "Idempotency-Key"
    # the same request however written: a default as null, a field in extra_body (helper-31's review)
    assert send({**body, "negative_prompt": None}, "k-1").json()["id"] == first["id"]
    assert send({k: v for k, v in body.items() if k != "seed"} | {"extra_body": {"seed": 1}}, "k-1").json()["id"] == \
        first["id"]
    elsewhere = send(body, "k-1", auth="Bearer someone-else").json()["id"]
    assert elsewhere != first["id"]  # keys are per caller: per API key, as the server reads it
    assert send(body, "k-1", auth="bearer   someone-else").json()["id"] == elsewhere
    for bad in ("", "x" * 256, "caf\u00e9"):
        r = httpx.post(f"{url}/v1/videos", json=body, timeout=30, headers={"Idempotency-Key": bad.encode("utf-8")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Idempotency-Key", bad
        if bad == "caf\u00e9":  # echoed as sent (it was 'cafÃ©': the header's UTF-8 read as Latin-1)
            assert "got 'caf\u00e9'" in r.json()["error"]["message"], r.text
    # two keys: a 400, not the first taken and the second ignored (helper-59)
    twice = httpx.post(f"{url}/v1/videos", json=body, timeout=30,
                       headers=[("Idempotency-Key", "k-1"), ("Idempotency-Key", "k-9")])
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "Idempotency-Key"
    assert twice.json()["error"]["message"] == "Idempotency-Key was sent 2 times; send it once"
    handle = serve.get_app_handle("ditserve")
    by_handle = handle.submit_video.remote(body, idempotency_key="k-1").result()
    assert by_handle.id != first["id"]  # the handle is another caller than HTTP
    assert handle.submit_video.remote(body, idempotency_key="k-1").result().id == by_handle.id
    # no header reaches the handle's keys: one that is no bearer token is no key, as none was sent
    assert send(body, "k-1", auth="handle").json()["id"] == first["id"]
    # a handle call's values of any type are a 400 naming the field (a list as video_id was a 500, a
    # number as the key a TypeError; helper-31's review)
    for call, field in ((lambda: handle.submit_video.remote(body, idempotency_key=123), "Idempotency-Key"),
                        (lambda: handle.submit_video.remote({"prompt": "x", 1: 2}, idempotency_key="k-2"), None),
                        (lambda: handle.video_status.remote(["a"]), "video_id"),
                        (lambda: handle.video_content.remote({"a": 1}), "video_id"),
                        (lambda: handle.delete_video.remote(None), "video_id")):
        with pytest.raises(InvalidRequestError) as info:
            call().result()
        assert info.value.status_code == 400 and (field is None or info.value.param == field), info.value
    assert httpx.delete(f"{url}/v1/videos/{first['id']}", timeout=30).status_code == 200
    # deleted, the key stays bound to it: a create still on its way (the CLI sends the create again on
    # Ctrl-C and deletes what it finds) does not make the job again (helper-30's review)
    late = send(body, "k-1")
    assert late.status_code == 400 and late.json()["error"]["code"] == "idempotency_key_deleted", late.text


def test_a_keys_namespace_is_the_api_key_the_auth_check_reads():
    """``caller_scope`` reads ``Authorization`` as ``BearerAuth`` does (helper-33's review: with two
    headers the key check took the last, the namespace the first, so a request authenticated as
    one key reached another key's jobs). Two headers are no key at all (helper-59: the last won,
    where a repeated Idempotency-Key or field is refused)."""
    from starlette.requests import Request

    from deployments.http import bearer_token, caller_scope

    def scope(*values: bytes) -> dict:
        return {"type": "http", "headers": [(b"authorization", v) for v in values]}

    assert bearer_token(scope(b"Bearer sk-b", b"Bearer sk-a")) is None
    assert bearer_token(scope(b"Bearer sk-a", b"Bearer sk-a")) is None
    assert caller_scope(Request(scope(b"bearer   sk-b"))) == caller_scope(Request(scope(b"Bearer sk-b")))
    anonymous = {caller_scope(Request(scope(*h))) for h in ((), (b"Basic x",), (b"Bearer",), (b"Bearer   ",),
                                                             (b"Basic x", b"Bearer sk-b"))}
    assert anonymous == {"http"}  # no key sent, whichever way: one namespace
    assert "handle" not in {caller_scope(Request(scope(v))) for v in (b"handle", b"Bearer handle")}
    assert caller_scope(Request(scope(b"Bearer \xff\xfe"))).startswith("http:")  # any bytes


def test_job_store_forgets_a_key_with_its_job():
    now = [0.0]
    store = JobStore(ttl_s=10, max_finished=1, clock=lambda: now[0])
    params = _params
    job = store.add(params(1), ("caller:k", "f1"))
    assert store.keyed(("caller:k", "f1")) is job and store.keyed(("caller:j", "f1")) is None
    with pytest.raises(InvalidRequestError, match="another request"):
        store.keyed(("caller:k", "f2"))
    store.pop("video_1")
    with pytest.raises(InvalidRequestError, match="was deleted") as info:  # a late create does not make it again
        store.keyed(("caller:k", "f1"))
    assert info.value.code == "idempotency_key_deleted"
    now[0] += 11  # past ttl_s: the deleted job's key is free
    assert store.keyed(("caller:k", "f1")) is None
    first = store.add(params(2), ("caller:a", "f"))
    first.finish(JobStatus.COMPLETED)
    second = store.add(params(3), None)
    second.finish(JobStatus.COMPLETED)
    store.add(params(4), None)  # evicts the oldest finished (max_finished 1), and its key
    assert store.keyed(("caller:a", "g")) is None
    # an unknown id names every reason, a Router's restart among them (helper-67: a CLI following a
    # job the Router forgot read "deleted")
    with pytest.raises(NotFoundError, match=r"no video job 'video_2' \(unknown, deleted, expired after its "
                                            r"retention, or forgotten by a restart of the server's Router\)"):
        store.get("video_2")


def test_deleted_keys_are_refused_for_ttl_s_beyond_max_finished():
    # helper-59: the deleted keys were capped at max_finished, so 5 keyed deletions under
    # max_finished 3 made the first 2 keys' late creates run again
    now = [0.0]
    store = JobStore(ttl_s=10, max_finished=3, max_deleted_keys=6, clock=lambda: now[0])
    for i in range(5):
        store.add(_params(i), (f"caller:k{i}", "f"))
        store.pop(f"video_{i}")
    for i in range(5):
        with pytest.raises(InvalidRequestError, match="was deleted"):
            store.keyed((f"caller:k{i}", "f"))
    for i in range(5, 8):  # the bound of its own: the oldest go first
        store.add(_params(i), (f"caller:k{i}", "f"))
        store.pop(f"video_{i}")
    assert [store.keyed((f"caller:k{i}", "f")) for i in (0, 1)] == [None, None]
    with pytest.raises(InvalidRequestError, match="was deleted"):
        store.keyed(("caller:k2", "f"))


@pytest.mark.parametrize("body, field", [
    ({"prompt": "a", "num_frames": 10}, "num_frames"),
    ({"prompt": "a", "num_frames": 21}, "num_frames"),
    ({"prompt": "a", "size": "128x128"}, "size"),
    ({"prompt": "a", "boundary_ratio": 0.5}, "boundary_ratio"),
    ({"prompt": "a", "cache_dit_params": {"secondary": {"Fn_compute_blocks": 1}}}, "cache_dit_params"),
])
def test_bad_video_input_is_400_naming_the_field(url, body, field):
    response = httpx.post(f"{url}/v1/videos", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_unknown_deleted_and_unready_jobs(url):
    assert httpx.get(f"{url}/v1/videos/video_nope", timeout=30).status_code == 404
    assert httpx.get(f"{url}/v1/videos/video_nope/content", timeout=30).status_code == 404
    job = httpx.post(f"{url}/v1/videos", json={"prompt": "a", "num_frames": 17, "num_inference_steps": 40},
                     timeout=30).json()
    early = httpx.get(f"{url}/v1/videos/{job['id']}/content", timeout=30)
    assert early.status_code == 400 and early.json()["error"]["code"] == "video_not_ready"
    deleted = httpx.delete(f"{url}/v1/videos/{job['id']}", timeout=30).json()
    assert deleted == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert httpx.get(f"{url}/v1/videos/{job['id']}", timeout=30).status_code == 404
    assert httpx.post(f"{url}/v1/images/generations", json={"prompt": "a"}, timeout=30).status_code == 400


def test_failed_job_shows_failed_with_the_error_while_others_complete(url):
    bad = httpx.post(f"{url}/v1/videos", json={"prompt": "a", "num_frames": 5, "num_inference_steps": 7},
                     timeout=30).json()
    good = httpx.post(f"{url}/v1/videos", json={"prompt": "a", "num_frames": 5}, timeout=30).json()
    (bad_job, _), (good_job, _) = poll(url, bad["id"]), poll(url, good["id"])
    assert bad_job["status"] == "failed" and bad_job["error"]["code"] == "batch_failed"
    assert bad["id"] in bad_job["error"]["message"]
    assert good_job["status"] == "completed"


def _params(i: int) -> SamplingParams:
    return SamplingParams(f"video_{i}", "m", "p", None, 1, 32, 32, 5, 4, GuidanceMode.NONE, 1.0, None, i, False, None,
                          1.0, None, "mp4", fps=8)


def test_a_thumbnail_asked_of_a_running_job_says_whether_a_preview_will_come():
    """helper-43: with ``videos.previews: 0`` a running job's thumbnail said "no preview of it
    was decoded yet; retry shortly", where none ever comes."""
    import dataclasses

    jobs = VideoJobs(JobStore(), wait=None)
    without = jobs.store.add(_params(1))  # partial_images None: the server decodes no previews
    with_previews = jobs.store.add(dataclasses.replace(_params(2), partial_images=2))
    for job in (without, with_previews):
        job.status = JobStatus.IN_PROGRESS
    with pytest.raises(InvalidRequestError, match="decodes no previews .* once it is completed") as info:
        jobs.content(without.params.request_id, "thumbnail")
    assert info.value.code == "video_not_ready"
    with pytest.raises(InvalidRequestError, match="no preview of it was decoded yet; retry shortly"):
        jobs.content(with_previews.params.request_id, "thumbnail")
    one_step = jobs.store.add(dataclasses.replace(_params(3), partial_images=2, num_inference_steps=1))
    one_step.status = JobStatus.IN_PROGRESS  # helper-44: no step before its last to preview
    with pytest.raises(InvalidRequestError, match=r"decodes no previews \(one step: none before its last\)"):
        jobs.content(one_step.params.request_id, "thumbnail")


def test_job_store_evicts_by_age_and_count():
    now = [100.0]
    store = JobStore(ttl_s=10, max_finished=2, clock=lambda: now[0])
    jobs = [store.add(_params(i)) for i in range(4)]
    for i, job in enumerate(jobs[:3]):
        job.finish(JobStatus.COMPLETED)
        job.completed_at = 100.0 + i
    now[0] = 105.0  # 3 finished, keep the newest 2; the running one stays
    assert sorted(j.params.request_id for j in store.all()) == ["video_1", "video_2", "video_3"]
    now[0] = 111.5  # video_1 finished at 101: past its 10 s
    assert sorted(j.params.request_id for j in store.all()) == ["video_2", "video_3"]
    assert store.get("video_2").view().expires_at == 112
    with pytest.raises(NotFoundError):
        store.get("video_1")


def test_job_store_evicts_a_large_expired_backlog_in_one_pass():
    """20,000 finished jobs (a burst gone idle), 15,000 past their ttl and a max of 4,000:
    one call keeps the newest 4,000, the running job, and answers 404 for the others (the old
    eviction was quadratic in them: 16,000 held the Router's event loop 1.1 s)."""
    now = [0.0]
    store = JobStore(ttl_s=100, max_finished=4000, clock=lambda: now[0])
    jobs = [store.add(_params(i)) for i in range(20_001)]
    for i, job in enumerate(jobs[:-1]):
        job.finish(JobStatus.COMPLETED)
        job.completed_at = float(i)
    now[0] = 15_000 + 100  # jobs 0..15000 are past their 100 s
    kept = {j.params.request_id for j in store.all()}
    assert kept == {f"video_{i}" for i in range(16_000, 20_001)}
    now[0] = 19_000 + 100  # a later call evicts by age alone
    assert len(store.all()) == 20_000 - 19_000 - 1 + 1
    with pytest.raises(NotFoundError):
        store.get("video_19000")


def test_job_pages_follow_openai_cursor_pagination():
    """``after`` is the previous page's ``last_id``; equal ``created_at`` ties break by id, so
    pages never overlap or skip a job in either order."""
    store = JobStore()
    for i in range(5):
        store.add(_params(i)).created_at = 100.0 + i // 2  # 100, 100, 101, 101, 102
    jobs = VideoJobs(store, wait=None)
    for order, expected in (("desc", [4, 3, 2, 1, 0]), ("asc", [0, 1, 2, 3, 4])):
        page, seen = jobs.list(2, None, order), []
        while True:
            seen += [j.id for j in page.data]
            assert (page.first_id, page.last_id) == (page.data[0].id, page.data[-1].id)
            if not page.has_more:
                break
            page = jobs.list(2, page.last_id, order)
        assert seen == [f"video_{i}" for i in expected], order
    assert jobs.list(5, None, "desc").has_more is False and jobs.list(4, None, "desc").has_more is True
    empty = jobs.list(0, None, "desc")
    assert empty.data == [] and empty.first_id is None and empty.last_id is None and empty.has_more
    assert jobs.list(3, "video_0", "desc").model_dump()["data"] == []
    with pytest.raises(InvalidRequestError) as refused:
        jobs.list(2, "video_" + "9" * 5000, "desc")
    assert refused.value.param == "after" and len(str(refused.value)) < 300 and "5006 characters" in str(refused.value)


def test_list_pages_through_the_openai_client_and_refuses_bad_parameters(url):
    from openai import BadRequestError, OpenAI
    from ray import serve

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    created = [httpx.post(f"{url}/v1/videos", json={"prompt": "a", "num_frames": 5, "num_inference_steps": 1,
                                                    "size": "32x32"}, timeout=30).json()["id"] for _ in range(5)]
    try:
        everything = httpx.get(f"{url}/v1/videos", params={"limit": 100}, timeout=30).json()
        newest_first = [j["id"] for j in everything["data"]]
        assert newest_first[:5] == created[::-1] and not everything["has_more"]
        first = client.videos.list(limit=2)
        assert [j.id for j in first.data] == [created[4], created[3]] and first.has_more and first.last_id == created[3]
        assert [j.id for j in client.videos.list(limit=2)] == newest_first  # the SDK's auto-pagination
        assert [j.id for j in client.videos.list(limit=3, order="asc")] == newest_first[::-1]
        assert len(httpx.get(f"{url}/v1/videos", timeout=30).json()["data"]) == min(20, len(newest_first))
        page = serve.get_app_handle("ditserve").list_videos.remote(limit=1, after=created[4]).result()
        assert [j.id for j in page.data] == [created[3]] and page.has_more

        for params, param in [({"limit": -1}, "limit"), ({"limit": 101}, "limit"), ({"limit": "2.0"}, "limit"),
                              ({"order": "newest"}, "order"), ({"after": "video_nope"}, "after"),
                              ({"limt": 2}, "limt"), ({"limit": [1, 2]}, "limit")]:
            refused = httpx.get(f"{url}/v1/videos", params=params, timeout=30)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (params, refused.text)
        message = httpx.get(f"{url}/v1/videos", params={"limit": "x", "order": "up"}).json()["error"]["message"]
        assert "limit must be an integer from 0 to 100" in message and "order must be one of asc, desc" in message
        with pytest.raises(BadRequestError, match="from 0 to 100"):
            client.videos.list(limit=-1)
        listed = httpx.get(f"{url}/openapi.json", timeout=30).json()["paths"]["/v1/videos"]["get"]["parameters"]
        assert {p["name"]: p["schema"]["type"] for p in listed} == {"limit": "integer", "after": "string",
                                                                    "order": "string"}  # limit showed as a string
    finally:
        for video_id in created:
            poll(url, video_id)  # nothing of this test left in flight for the next


def test_routes_without_query_parameters_refuse_any(url):
    """A query parameter on a route that takes none is a 400 naming it (``?n=2`` on a generation was
    ignored without a word, as an unknown body field is not); no job is created by a refused one."""
    created = httpx.post(f"{url}/v1/videos", json={"prompt": "a", "num_frames": 5, "num_inference_steps": 1,
                                                   "size": "32x32"}, timeout=30).json()["id"]
    poll(url, created)
    before = len(httpx.get(f"{url}/v1/videos", params={"limit": 100}, timeout=30).json()["data"])
    body = {"prompt": "a", "num_frames": 5, "num_inference_steps": 1, "size": "32x32"}
    for method, path, kwargs in [("POST", "/v1/images/generations", {"json": {"prompt": "a"}}),
                                 ("POST", "/v1/images/edits", {"files": {"image": b"x"}, "data": {"prompt": "a"}}),
                                 ("POST", "/v1/videos", {"json": body}), ("GET", f"/v1/videos/{created}", {}),
                                 ("DELETE", f"/v1/videos/{created}", {}), ("GET", "/v1/models", {}),
                                 ("GET", "/v1/stats", {})]:
        refused = httpx.request(method, f"{url}{path}", params={"n": 2}, timeout=30, **kwargs)
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "n", (path, refused.text)
        assert "unknown query parameter" in error["message"] and "accepted: none" in error["message"]
    assert len(httpx.get(f"{url}/v1/videos", params={"limit": 100}, timeout=30).json()["data"]) == before
    assert httpx.get(f"{url}/v1/videos/{created}", timeout=30).json()["status"] == "completed"  # not deleted


def test_a_long_video_id_is_cut_in_every_message_that_echoes_it(url):
    long_id = "video_" + "x" * 5000
    for method, path in [("GET", ""), ("GET", "/content"), ("GET", "/content?variant=thumbnail"), ("DELETE", "")]:
        answer = httpx.request(method, f"{url}/v1/videos/{long_id}{path}", timeout=30)
        error = answer.json()["error"]
        assert answer.status_code == 404 and error["code"] == "video_not_found", (method, path)
        assert len(error["message"]) < 300 and "(5006 characters)" in error["message"], error["message"]
    refused = httpx.get(f"{url}/v1/videos/video_nope/content", params={"variant": "video", "x" * 5000: "1"})
    assert refused.status_code == 400 and len(refused.json()["error"]["message"]) < 300


def test_a_slash_for_a_video_id_is_a_404_envelope_not_a_redirect_to_the_list(url):
    """helper-77: ``/v1/videos/%2F`` (an empty path segment) was a 307 to ``/v1/videos``, which the
    SDK followed: ``client.videos.retrieve("/")`` returned the job list read as a Video. One trailing
    slash still redirects, as on every route (helper-61)."""
    from openai import NotFoundError as SdkNotFoundError

    for method, path in [("GET", "/v1/videos/%2F"), ("DELETE", "/v1/videos/%2F"), ("GET", "/v1/videos/%2F/content"),
                         ("POST", "/v1/videos//"), ("GET", "/v1//models")]:
        answer = httpx.request(method, f"{url}{path}", timeout=30)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", (method, path, answer.text)
    with pytest.raises(SdkNotFoundError):
        openai_client(url).videos.retrieve("/")
    for path in ("/v1/videos/", "/v1/models/"):
        assert httpx.get(f"{url}{path}", follow_redirects=True, timeout=30).status_code == 200, path


def test_deadline_passing_mid_batch_fails_the_job_for_good(url):
    """The deadline is a third of the same job's measured denoising time: a fixed 3 s let the job
    finish on a faster machine (100 steps of 17 frames took 2.5 s once CPU attention got faster)."""
    body = {"prompt": "a", "seed": 11, "num_frames": 17, "num_inference_steps": 100}
    untimed, _ = poll(url, httpx.post(f"{url}/v1/videos", json=body, timeout=30).json()["id"])
    assert untimed["status"] == "completed", untimed["error"]
    denoise_s = untimed["ditserve"]["timings_ms"]["denoise"] / 1e3
    job = httpx.post(f"{url}/v1/videos", json={**body, "timeout_s": denoise_s / 3}, timeout=30).json()
    final, _ = poll(url, job["id"])
    assert final["status"] == "failed" and final["error"]["code"] == "timeout"
    time.sleep(denoise_s)  # the batch may still be running: its progress must not revive the job
    again = httpx.get(f"{url}/v1/videos/{job['id']}", timeout=30).json()
    assert again["status"] == "failed" and again["error"]["code"] == "timeout"
    assert 0 < again["progress"] < 100  # it timed out while its batch ran
    content = httpx.get(f"{url}/v1/videos/{job['id']}/content", timeout=30)  # never will have any: not "not ready"
    assert content.status_code == 400 and content.json()["error"]["code"] == "video_failed"


def test_openai_form_with_lists_and_more_edges(url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    job = client.videos.create(prompt="a blue square", size="32x32", extra_body={
        "num_frames": 5, "num_inference_steps": 4, "enable_cache_dit": True,
        "cache_dit_params": {"Fn_compute_blocks": 1, "scm_compute_bins": [2, 1], "scm_cache_bins": [1, 1]}})
    final, _ = poll(url, job.id)
    assert final["status"] == "completed", final["error"]
    assert final["ditserve"]["acceleration"]["cache_dit"]["active"]
    listed = httpx.get(f"{url}/v1/videos", timeout=30).json()
    assert listed["object"] == "list" and job.id in [j["id"] for j in listed["data"]]
    huge = httpx.post(f"{url}/v1/videos", json={"prompt": "a", "seconds": 1e308}, timeout=30)
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "seconds"
    missing = httpx.get(f"{url}/v1/videos/x/nothing", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    r = httpx.post(f"{url}/v1/videos/{job.id}/remix", json={"prompt": "x"}, timeout=30)  # OpenAI's; not served
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_operation", r.text


def test_video_forms_decode_lists_of_objects_and_refuse_repeats_and_loose_seconds(url):
    """videos.create is always multipart: extra_body={"lora": [...]} was a 400 ("[] only at the
    end"); here it reaches validation (tiny-wan registers no adapter: a 404 naming it). seconds
    took "١" and "1e-300"; -F prompt=a -F prompt=b kept one of them. Nothing is queued."""
    from openai import BadRequestError, NotFoundError, OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError, match="LoRA adapter 'nope' is not registered"):
        client.videos.create(prompt="a", seconds="1", extra_body={"lora": [{"name": "nope", "scale": 0.5},
                                                                           {"name": "other", "scale": 1}]})
    for seconds in ("\u0661", "1e-300", "1.5"):
        with pytest.raises(BadRequestError, match="whole number of seconds") as info:
            client.videos.create(prompt="a", seconds=seconds)
        assert info.value.param == "seconds"
    for form, param in (({"files": [("prompt", (None, b"a")), ("prompt", (None, b"b"))]}, "prompt"),  # curl -F
                        ({"data": {"prompt": "a", "seed": ["1", "2"]}}, "seed")):  # url-encoded
        r = httpx.post(f"{url}/v1/videos", **form, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "given more than once" in r.json()["error"]["message"]


def test_cli_video_shows_a_progress_bar_and_writes_the_mp4(url, tmp_path, capsys):
    from deployments.cli import main

    out = tmp_path / "clip.mp4"
    assert main(["video", "a red circle", "-o", str(out), "--url", url, "--size", "32x32", "--steps", "3",
                 "--extra", '{"num_frames": 5}']) == 0
    frames, _ = decode_mp4(out.read_bytes())
    assert frames.shape == (5, 32, 32, 3)
    err = capsys.readouterr().err
    assert "completed: 100%" in err and "Traceback" not in err
    assert main(["video", "a", "-o", str(tmp_path / "x.mp4"), "--url", url, "--extra", '{"num_frames": 10}']) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error 400 invalid_value (num_frames)"), err


def test_cli_a_failed_job_is_one_line_with_its_code_and_message(url, tmp_path, capsys):
    from deployments.cli import main

    out = tmp_path / "bad.mp4"
    assert main(["video", "a", "-o", str(out), "--url", url, "--steps", "7", "--extra", '{"num_frames": 5}']) == 1
    line = capsys.readouterr().err.splitlines()[-1]  # after the progress bar's lines
    assert line.startswith("error batch_failed: video video_") and "failed: " in line, line
    assert "VideoCreateError" not in line and "failed: batch batch-" in line, line  # the message, not the SDK's repr
    assert not out.exists()
