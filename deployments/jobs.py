"""Video jobs (OpenAI's video API: create, retrieve, list, content, delete), kept in the Router.

A job wraps one queued video request: it is admitted and enqueued when it is created (so a job
answered 200 is never refused later), moves to ``in_progress`` when its batch is dispatched,
follows the denoising steps in ``progress``, and ends ``completed`` or ``failed`` (with the
error), never stuck. Finished jobs are kept ``ttl_s`` seconds and at most ``max_finished`` of
them; then their id answers 404.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from pipeline.contract.text import shown
from pipeline.contract.videos import JobStatus, ListOrder, VideoJob, VideoJobMetadata, VideoList
from pipeline.errors import DitServeError, InvalidRequestError, NotFoundError
from pipeline.sampling import SamplingParams
from pipeline.wire import GenerationMetadata, RequestOutput

# why an id names no job: jobs live in the Router's memory, so its restart forgets them all (helper-67:
# a CLI following a job read the same words as for one deleted by someone else)
JOB_GONE = "unknown, deleted, expired after its retention, or forgotten by a restart of the server's Router"


@dataclass(eq=False)
class Job:
    """One video job: its request, state, output and timestamps (Unix seconds)."""

    params: SamplingParams
    created_at: float = field(default_factory=time.time)
    status: JobStatus = JobStatus.QUEUED
    progress: int = 0
    completed_at: float | None = None
    ttl_s: float = 3600.0
    error: dict | None = None
    output: RequestOutput | None = None
    task: asyncio.Task | None = None
    preview: bytes | None = None  # the latest preview frame (WebP) while it runs
    idempotency: tuple[str, str] | None = None  # (scoped Idempotency-Key, its request's fingerprint)

    def finish(self, status: JobStatus, error: dict | None = None) -> None:
        self.status, self.error, self.completed_at = status, error, time.time()
        if status == JobStatus.COMPLETED:
            self.progress = 100

    def on_progress(self, done: int, steps: int) -> None:
        """Its batch ran ``done`` of ``steps`` denoising steps."""
        if self.completed_at is not None:  # failed already (deadline, deletion): its batch runs on
            return
        self.status = JobStatus.IN_PROGRESS
        self.progress = max(self.progress, min(99, int(100 * done / steps)))

    def on_preview(self, event: dict) -> None:
        """Its batch decoded a preview of it: the first frame of the current prediction (WebP)."""
        if self.completed_at is None and event.get("images"):
            self.preview = event["images"][0]

    def view(self) -> VideoJob:
        p = self.params
        result = {} if self.output is None else GenerationMetadata.of(self.output).model_dump()
        return VideoJob(
            id=p.request_id, model=p.model, status=self.status, progress=self.progress,
            created_at=int(self.created_at),
            completed_at=None if self.completed_at is None else int(self.completed_at),
            expires_at=None if self.completed_at is None else int(self.completed_at + self.ttl_s),
            size=f"{p.width}x{p.height}", seconds=f"{p.num_frames / p.fps:g}", error=self.error, prompt=p.prompt,
            ditserve=VideoJobMetadata(num_frames=p.num_frames, fps=p.fps, **{**result, "seed": p.seed}))


class JobStore:
    """Video jobs by id. Finished jobs are evicted ``ttl_s`` seconds after they finish, and
    beyond ``max_finished`` finished jobs the oldest go first; running ones are never evicted.
    A deleted job's ``Idempotency-Key`` stays refused ``ttl_s`` seconds, for the last
    ``max_deleted_keys`` keyed deletions."""

    def __init__(self, ttl_s: float = 3600.0, max_finished: int = 100, max_deleted_keys: int = 10_000,
                 clock: Callable[[], float] = time.time):
        self.ttl_s = ttl_s
        self.max_finished = max_finished
        self.max_deleted_keys = max_deleted_keys
        self._clock = clock  # Unix seconds
        self._jobs: dict[str, Job] = {}
        self._keyed: dict[str, Job] = {}  # scoped Idempotency-Key -> its job, while the job is kept
        # scoped Idempotency-Key -> (its deleted job's id, request fingerprint, when deleted), kept
        # ttl_s and at most max_deleted_keys of them: a create arriving late does not make the job again
        self._deleted_keys: dict[str, tuple[str, str, float]] = {}

    def add(self, params: SamplingParams, idempotency: tuple[str, str] | None = None) -> Job:
        """A new job for ``params``; ``idempotency``: ``(scoped key, request fingerprint)`` of
        an ``Idempotency-Key`` (:meth:`keyed` finds the job by it while it is kept)."""
        self.evict()
        job = Job(params, ttl_s=self.ttl_s, idempotency=idempotency)
        self._jobs[params.request_id] = job
        if idempotency is not None:
            self._keyed[idempotency[0]] = job
        return job

    def keyed(self, idempotency: tuple[str, str]) -> Job | None:
        """The kept job created with this ``Idempotency-Key`` (scoped), or None. Raises
        ``InvalidRequestError`` (``param`` ``Idempotency-Key``, code ``idempotency_key_reused``)
        when that job's request was another (its fingerprint differs): a key names one request."""
        self.evict()
        job = self._keyed.get(idempotency[0])
        if job is not None and job.idempotency[1] != idempotency[1]:
            raise InvalidRequestError(f"Idempotency-Key was used for another request (video job {job.params.request_id}"
                                      "); a key names one request: send a new key for a new request",
                                      param="Idempotency-Key", code="idempotency_key_reused")
        if job is None and idempotency[0] in self._deleted_keys:
            # its job was deleted (a client's Ctrl-C that sent the create again, then deleted what it
            # found, while the first create was still on its way): making it again would run unseen
            job_id, _, _ = self._deleted_keys[idempotency[0]]
            raise InvalidRequestError(f"the video job this Idempotency-Key made ({job_id}) was deleted; send a new key "
                                      "for a new job", param="Idempotency-Key", code="idempotency_key_deleted")
        return job

    def _forget(self, job: Job) -> None:
        del self._jobs[job.params.request_id]
        if job.idempotency is not None and self._keyed.get(job.idempotency[0]) is job:
            del self._keyed[job.idempotency[0]]

    def get(self, job_id: str) -> Job:
        """The job. Raises ``NotFoundError`` (404) for an unknown, deleted or evicted id."""
        self.evict()
        if job_id not in self._jobs:
            raise NotFoundError(f"no video job {shown(job_id)} ({JOB_GONE})", param="video_id", code="video_not_found")
        return self._jobs[job_id]

    def all(self, order: ListOrder = ListOrder.DESC) -> list[Job]:
        """Every job kept by ``created_at`` (then id, so that pages never overlap), newest first
        (``desc``) or oldest first (``asc``)."""
        self.evict()
        return sorted(self._jobs.values(), key=lambda j: (j.created_at, j.params.request_id),
                      reverse=order == ListOrder.DESC)

    def pop(self, job_id: str) -> Job:
        """Delete job ``job_id``; its Idempotency-Key, if any, stays bound to it (:meth:`keyed`)
        for ``ttl_s``. Raises ``NotFoundError`` (404)."""
        job = self.get(job_id)
        self._forget(job)
        if job.idempotency is not None:
            self._deleted_keys[job.idempotency[0]] = (job_id, job.idempotency[1], self._clock())
        return job

    def evict(self) -> None:
        """Drop the finished jobs past ``ttl_s`` and the oldest beyond ``max_finished``: one
        pass over the jobs, sorted only when some go (it was quadratic in the finished jobs:
        16,000 expiring at once held the Router's event loop for 1.1 s)."""
        now = self._clock()
        while self._deleted_keys and (len(self._deleted_keys) > self.max_deleted_keys
                                      or next(iter(self._deleted_keys.values()))[2] + self.ttl_s <= now):
            del self._deleted_keys[next(iter(self._deleted_keys))]  # oldest first (insertion order)
        finished = [j for j in self._jobs.values() if j.completed_at is not None]
        over = len(finished) - self.max_finished
        if over <= 0 and not any(j.completed_at + self.ttl_s <= now for j in finished):
            return
        finished.sort(key=lambda j: j.completed_at)  # the expired ones are a prefix of it
        expired = next((i for i, j in enumerate(finished) if j.completed_at + self.ttl_s > now), len(finished))
        for job in finished[:max(expired, over)]:
            self._forget(job)


class VideoJobs:
    """The job API over a :class:`JobStore`. ``wait(params, on_progress)`` is the Router's: it
    awaits an already admitted and enqueued request's output (raising its error)."""

    def __init__(self, store: JobStore, wait: Callable[..., Awaitable[RequestOutput]]):
        self.store = store
        self._wait = wait

    def track(self, job: Job, enqueued) -> VideoJob:
        """Follow ``job``'s request, which the Router has just admitted and enqueued
        (``enqueued``: its queue entry, with ``job.on_progress`` as its progress callback), to
        its end; return the job at once (``status: queued``)."""
        # a fresh context: the job outlives the request that created it (Serve cancels what a
        # cancelled request started)
        job.task = asyncio.get_running_loop().create_task(self._run(job, enqueued), context=contextvars.Context())
        return job.view()

    async def _run(self, job: Job, enqueued) -> None:
        try:
            job.output = await self._wait(enqueued)
            job.finish(JobStatus.COMPLETED)
        except asyncio.CancelledError:
            job.finish(JobStatus.FAILED, {"code": "cancelled", "message": "the job was deleted"})
        except DitServeError as exc:
            job.finish(JobStatus.FAILED, {"code": exc.code or type(exc).__name__, "message": str(exc)})
        except Exception as exc:  # never leave a job in_progress
            job.finish(JobStatus.FAILED, {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"})

    def list(self, limit: int, after: str | None = None, order: ListOrder = ListOrder.DESC) -> VideoList:
        """One page of the jobs kept (queued, running and finished within retention) in ``order``
        of ``created_at``: at most ``limit`` of them, from the one after the job ``after`` (the
        previous page's ``last_id``). Raises ``InvalidRequestError`` (400) when ``after`` is no
        job kept (unknown, deleted or evicted since)."""
        jobs = self.store.all(order)
        start = 0
        if after is not None:
            ids = [job.params.request_id for job in jobs]
            if after not in ids:
                raise InvalidRequestError(f"after must be the id of a video job kept (a page's last_id); no job "
                                          f"{shown(after)} ({JOB_GONE}): list "
                                          "again without after", param="after", code="invalid_value")
            start = ids.index(after) + 1
        page = [job.view() for job in jobs[start:start + limit]]
        return VideoList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                         has_more=start + limit < len(jobs))

    def get(self, job_id: str) -> VideoJob:
        """The job's object. Raises ``NotFoundError`` (404) for an unknown or evicted id."""
        return self.store.get(job_id).view()

    def content(self, job_id: str, variant: str = "video") -> bytes:
        """The finished job's MP4 bytes (``variant`` ``video``) or its thumbnail, the first
        frame as WebP (``thumbnail``; while the job runs, the first frame of its latest preview,
        once one was decoded). Raises ``NotFoundError`` (404), or ``InvalidRequestError`` (400)
        while the job is not completed (for a thumbnail: and has no preview yet; the message says
        whether one will come)."""
        job = self.store.get(job_id)
        if variant == "thumbnail" and job.status == JobStatus.IN_PROGRESS and job.preview is not None:
            return job.preview
        if job.status != JobStatus.COMPLETED:
            if variant == "thumbnail" and job.status in (JobStatus.QUEUED, JobStatus.IN_PROGRESS):
                if not job.params.partial_images or job.params.effective_steps < 2:
                    # none will come ("retry shortly" would be wrong advice): previews are off, or a
                    # one-step run has no step before its last to preview (pipeline.loop.preview_steps)
                    why = ("the server's videos.previews is 0" if not job.params.partial_images
                           else "one step: none before its last")
                    raise InvalidRequestError(f"video {job_id} is {job.status} and decodes no previews ({why}); "
                                              "its thumbnail exists once it is completed", param="video_id",
                                              code="video_not_ready")
                raise InvalidRequestError(f"video {job_id} is {job.status} and no preview of it was decoded yet; "
                                          "retry shortly (its thumbnail is its latest preview while it runs)",
                                          param="video_id", code="video_not_ready")
            if job.status == JobStatus.FAILED:  # never will it have content: not "not ready", which says wait
                raise InvalidRequestError(f"video {job_id} failed and has no content (GET /v1/videos/{job_id} says "
                                          "why); create it again", param="video_id", code="video_failed")
            raise InvalidRequestError(f"video {job_id} is {job.status}; its content exists once it is completed",
                                      param="video_id", code="video_not_ready")
        return job.output.images[0] if variant == "thumbnail" else job.output.videos[0]

    def delete(self, job_id: str) -> dict:
        """Forget a job; a queued or running one is cancelled (it leaves its queue; in a running
        batch its rows are dropped at the next step boundary, or the batch stops if nobody else
        waits for it). Raises ``NotFoundError`` (404)."""
        job = self.store.pop(job_id)
        if job.task is not None and not job.task.done():
            job.task.cancel()
        return {"id": job_id, "object": "video.deleted", "deleted": True}
