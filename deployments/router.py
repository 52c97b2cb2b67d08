"""Router: one FIFO queue per batch signature; forms batches and hands them to replicas.

It decides what runs next and never touches a tensor (it imports no torch). Batches are formed
only when a replica can take one (late binding); which queue is cut is
``deployments.scheduling``'s pure decision (readiness, state affinity, starvation bound). Every
accepted request gets exactly one answer: its output, or an error (failed batch, deadline); if
the Router itself stops or dies first, the Ingress answers for it (503 ``unavailable``; when its
app is being deleted, the Router answers its queued requests so itself at once). One
admission check (:meth:`Router._admit`) serves image requests and video jobs.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import itertools
import logging
import os
import time
import uuid
from collections import Counter as Tally
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.metrics import Counter, Gauge, Histogram
from ray.serve.schema import ApplicationStatus, DeploymentStatus

from compat import ray_serve as compat
from deployments.config import admission_limit_of, batching_update, queued_batch_limit
from deployments.jobs import JobStore, VideoJobs
from deployments.live_config import LiveUpdates
from deployments.memory import IdleTrimmer
from deployments.replica_chooser import adapters_refused_everywhere, chooser_for, replica_count
from deployments.scheduling import QueueView, ReplicaView, choose_queue, is_urgent, next_wakeup_s
from deployments.serve_logs import answers_are_not_failures, no_access_log
from pipeline.contract.videos import ListOrder, VideoJob, VideoList
from pipeline.errors import (DitServeError, InternalError, InvalidRequestError, OverloadedError,
                             ReplicaUnavailableError, RequestTimeoutError, ServiceUnavailableError)
from pipeline.modes import InputMode, Priority
from pipeline.sampling import SamplingParams
from pipeline.signature import BatchSignature
from pipeline.wire import Batch, ModelFacts, RequestOutput

logger = logging.getLogger("ray.serve")

# Re-check the replica set this often while requests wait and no replica looks free
# (a replica added or replaced by Serve does not signal the router).
REPLICA_POLL_S = 0.1
# A request whose batch a broken or dead replica refused before running it goes back to the
# head of its queue at most this many times.
MAX_REQUEUES = 2
# A caller (an Ingress replica) renews its lease every second while it lives; its requests are
# dropped (queued) or cancelled (running) once its lease is this old: it died with them.
CALLER_LEASE_S = 5.0
# Longest wait for the controller's app status (Router._answer_queued_if_unservable).
STATUS_TIMEOUT_S = 2.0
STATUS_MIN_INTERVAL_S = 1.0  # the app's status is read at most this often
# ditserve_batch_images' bucket edges (images): between whole sizes, so that sizes 1 and 2 have
# buckets of their own and none sits on an edge (see the Histogram). A new name for new edges: Ray's
# metrics agent keeps a histogram's first bounds per node and skips data points of others
# (record_histogram_aggregated_batch), so the old ditserve_batch_size would vanish on a node that saw it
BATCH_SIZE_BUCKETS = [0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5]


@dataclass(eq=False)
class _Pending:
    """One admitted request in its signature's queue, until its batch answers it. Its future
    is cancelled when its caller goes away (disconnect, cancelled handle call, deadline)."""

    params: SamplingParams
    signature: BatchSignature
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)
    on_progress: Callable[[int, int], None] | None = None  # (steps done, steps) while its batch runs
    requeues: int = 0  # times a replica refused its batch before running it
    caller: str | None = None  # the Ingress replica waiting for it (None: a video job, kept here)
    on_preview: Callable[[dict], None] | None = None  # its streamed previews, while its batch runs

    @property
    def cost(self) -> float:
        return request_cost(self.params)


def request_cost(p: SamplingParams) -> float:
    """Pixels the batch's forwards see for request ``p`` (``max_batch_cost``'s unit: pixels ×
    frames × n; reference images join the sequence)."""
    references = p.num_input_images if p.input_mode == InputMode.REFERENCE else 0
    return float(p.width * p.height * p.num_frames * p.n * (1 + references))


def cost_fix(p: SamplingParams, max_batch_cost: float) -> tuple[str, str]:
    """(field, fix in words) for request ``p`` past ``max_batch_cost``: the field that alone can
    make it fit (helper-79, -82: it was always ``size``): ``n``, else a reference edit's input
    images (``image``), else ``size`` (a video's frames too)."""
    per_image = p.width * p.height * p.num_frames
    fitting_n = int(max_batch_cost // (request_cost(p) / p.n))
    fitting_images = int(max_batch_cost // (per_image * p.n)) - 1
    if fitting_n:
        return "n", f"ask for n at most {fitting_n}"
    if p.input_mode == InputMode.REFERENCE and fitting_images >= 1:
        return "image", f"give at most {fitting_images} input images"
    return "size", "a smaller size" + (" or fewer frames (num_frames, seconds)" if p.num_frames > 1 else "")


def _for_request(error: DitServeError, params: SamplingParams) -> DitServeError:
    """A failed batch's ``error`` as request ``params`` is answered with it: one about a LoRA
    adapter (``pipeline.errors.about_adapter``) names the field this request named it in."""
    adapter = getattr(error, "adapter", None)
    if adapter is None or params.adapter_field(adapter) == error.param:
        return error
    own = copy.copy(error)
    own.param = params.adapter_field(adapter)
    return own


@serve.deployment(num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
class Router:
    """Queues, batch formation and replica choice for one DiTReplica deployment.

    The batching knobs (``deployments.config.BatchingConfig``) arrive as Serve's
    ``user_config`` through :meth:`reconfigure`, so they change without a restart.
    ``capacity``: batches that may run at once while the replica set is not yet known.
    Raises ``ValueError`` when its deployment asks for more than one replica (a Serve config
    file's ``deployments`` entry applied by a live ``serve deploy``, which ``bind_app`` never
    sees): its queues, counters and video jobs are its own, so a second Router's jobs would
    404 on the first. A fresh deploy is then ``DEPLOY_FAILED`` with this message; onto a
    running app the running Router serves on while Serve retries the second.

    Every method a handle or Serve calls is ``async``: Serve runs a plain ``def`` in a thread
    pool (``RAY_SERVE_RUN_SYNC_IN_THREADPOOL``), where it raced the event loop that owns the
    queues, leases and video jobs (``tests/test_architecture.py`` checks the three deployments).
    """

    def __init__(self, replica, capacity: int, videos: dict | None = None, routing_nice: int = 0,
                 batching: dict | None = None, limits: dict | None = None, video: bool | None = None):
        asked = compat.most_replicas()
        if asked != 1:
            raise ValueError(f"the Router runs as one replica (it holds the queues and the video jobs); its "
                             f"deployment asks for {asked}: drop the Router entry's num_replicas / "
                             "autoscaling_config (scale DiTReplica, or the Ingress)")
        os.nice(routing_nice)  # below the proxy, which answers refusals (replica.routing_nice)
        answers_are_not_failures()  # a 429 or 400 it raises is one log line, not a traceback
        no_access_log()  # its calls are the app's own: a lease renewed every second, long polls
        self._replica = replica
        self._stream = replica.options(stream=True)  # run_batch yields progress, then the outputs
        self._capacity = capacity
        videos = dict(videos or {})
        self._video_previews = int(videos.pop("previews", 0))  # preview frames a running job decodes
        self._jobs = VideoJobs(JobStore(**videos), self._wait)
        self._args_batching = dict(batching or {})  # args' knobs: what a user_config leaves out keeps
        self._limits = limits  # args' limits: what the knobs must be able to batch (None: not checked)
        self._known_video = video  # whether the model makes videos, where the config tells (None: not known)
        self._facts: ModelFacts | None = None
        self._apply_batching(self._batching_update(None).model_dump())
        self._queues: dict[BatchSignature, deque[_Pending]] = {}
        self._queued = 0
        self._queued_by_priority = Tally()  # queued requests per priority (the queue-depth gauge)
        self._inflight = 0
        self._idle_since: float | None = time.monotonic()  # when the last batch in flight ended (None: one is)
        self._claims: dict[str, str] = {}  # batch_id -> replica it was meant for, while in flight
        self._running: dict[str, list[_Pending]] = {}  # batch_id -> its requests, while in flight
        self._unstarted: dict[str, asyncio.Task] = {}  # batch_id -> its dispatch, until a replica takes it
        self._callers_changed: dict[str, asyncio.Event] = {}  # batch_id -> set when one of its callers left
        self._leases: dict[str, float] = {}  # caller -> when it last renewed its lease (monotonic)
        self._reached = time.monotonic()  # when a caller last reached this Router (submit or renewal)
        self._saw_replicas = False  # the replica set has been known (non-empty) at least once
        self._deleting = False  # its app read DELETING: nothing more is dispatched
        self._deploy_failed = False  # no DiTReplica left and Serve gave up starting one (DEPLOY_FAILED)
        self._unservable = asyncio.Event()  # set while one of the two above holds
        self._status_read: asyncio.Task | None = None  # the serve.status() read in flight
        self._status_read_at = -float("inf")  # when the last one ended (monotonic)
        self._facts_waiting = 0  # model_facts calls waiting for a DiTReplica to answer
        self._trimmer = IdleTrimmer(lambda: self._queued + self._inflight)
        self._wakeup = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None  # _expire_callers: leases, the status watch, the queue-depth gauge
        self._batch_ids = itertools.count()
        self._counters = Tally()
        self._live = LiveUpdates("Router")
        # By priority, not by signature: a signature's label would be a new series for every
        # float a client sends (guidance_scale, a LoRA scale), kept by Ray for good.
        self._metric_queue_depth = Gauge("ditserve_queue_depth", "Requests queued, by priority",
                                         tag_keys=("priority",))
        # Ray rebuilds a histogram's _sum from its buckets' midpoints (OpenTelemetryMetricRecorder.
        # record_histogram_aggregated_batch): edges between whole sizes make batches of 1 and 2
        # exact (edges at 1, 2, 4 ... counted a batch of 1 as 0.5, of 2 as 1.5)
        self._metric_batch_size = Histogram("ditserve_batch_images", "Images per dispatched batch",
                                            boundaries=BATCH_SIZE_BUCKETS)
        self._metric_queue_wait = Histogram("ditserve_queue_wait_ms", "Time a request waited in its queue (ms)",
                                            boundaries=[1, 5, 10, 25, 50, 100, 250, 500, 1000, 5000, 30000])
        self._metric_routing = Counter("ditserve_routing_decisions", "Batches dispatched, by routing decision",
                                       tag_keys=("decision",))
        self._metric_rejections = Counter("ditserve_rejections", "Requests answered with an error, by reason",
                                          tag_keys=("reason",))
        self._metric_cancelled = Counter("ditserve_cancelled_running", "Running work stopped because its callers "
                                         "left: whole batches, and requests whose rows left their batch",
                                         tag_keys=("scope",))
        self._metric_cancelled_queued = Counter("ditserve_cancelled_queued", "Queued requests never run because "
                                                "their callers left (disconnect, cancelled handle call, deleted "
                                                "video job, lease lost)")
        self._metric_batches = Counter("ditserve_batches", "Batches that finished with their outputs")
        self._metric_requests = Counter("ditserve_requests", "Requests answered with their outputs")
        self._metric_failed_batches = Counter("ditserve_failed_batches", "Batches that failed (their requests "
                                              "answered with an error)")
        self._metric_requeued = Counter("ditserve_requeued", "Requests put back in their queue because their batch "
                                        "was not run (its replica stopped before starting it)")
        self._metric_steps_saved = Counter("ditserve_steps_saved", "Denoising steps not run because their callers "
                                           "left: a stopped batch's steps, a dropped request's steps x n",
                                           tag_keys=("scope",))
        try:  # the watch from the start: the queue-depth gauge was not exported until a first request (helper-67)
            self._start_watch()
        except RuntimeError:  # no loop here (Serve builds replicas in its loop): the first call starts it
            pass

    async def reconfigure(self, batching: dict) -> None:
        """Serve's ``user_config`` hook: new batching knobs apply to the next batch formed; a knob
        the ``user_config`` leaves out takes ``args``' value (``batching``, as built; it took
        ``BatchingConfig``'s default: a ``max_wait_ms``-only update ran ``max_batch_size`` 8 where
        ``args`` said 2). Knobs that fail ``BatchingConfig`` are refused, those in force stay
        (``deployments.live_config``; at start they raise ``ValidationError``)."""
        def apply(knobs: dict) -> None:
            self._apply_batching(self._batching_update(knobs).model_dump())
            self._wakeup.set()
        await self._live.apply(batching, apply)

    def _batching_update(self, knobs: dict | None):
        """``deployments.config.batching_update`` over args' knobs, refusing a ``max_batch_cost``
        under which the request giving a prompt alone could not run: its frames and input image
        counted as the model's facts say once a replica told them, as the config says before (a
        checkpoint's: one frame)."""
        facts = self._facts
        video = facts.temporal_factor > 0 if facts is not None else self._known_video
        return batching_update(self._args_batching, knobs, self._limits, video,
                               facts is not None and facts.edits_by_reference_only)

    async def check_health(self) -> None:
        """Serve's health check (also run once the start's ``reconfigure`` is done): from then on
        a bad ``user_config`` update is refused, not raised."""
        self._live.started()

    def _apply_batching(self, batching: dict) -> None:
        self._max_batch_size = int(batching["max_batch_size"])
        self._max_wait_s = float(batching["max_wait_ms"]) / 1e3
        self._max_queued = int(batching["max_queued_requests"])
        self._max_queued_batch = queued_batch_limit(self._max_queued, batching.get("max_queued_batch_requests"))
        # as /v1/stats shows it: the limits in force (max_queued_batch_requests null: the default it resolves to)
        self._batching = {**batching, "max_queued_batch_requests": self._max_queued_batch}
        self._max_batch_cost = batching.get("max_batch_cost")
        self._affinity = bool(batching.get("affinity", True))
        self._max_affinity_wait_s = float(batching.get("max_affinity_wait_ms", 2000)) / 1e3
        self._switch_cost_s = float(batching.get("affinity_switch_cost_ms", 250)) / 1e3
        self._max_batch_priority_wait_s = float(batching.get("max_batch_priority_wait_ms", 30_000)) / 1e3

    async def model_facts(self) -> ModelFacts:
        """The served model's facts (asked of a DiTReplica once, then kept). Waits for a replica
        while one is starting; raises ``ServiceUnavailableError`` (503 ``unavailable``) when the
        app is being deleted or no DiTReplica is left and Serve gave up starting one, also for a
        call already waiting when that is found (a new Router of a redeploy whose replicas
        fail: its Ingress asks this before it validates any request)."""
        if self._facts is not None:
            return self._facts
        self._refuse_if_unservable(None)
        self._start_loops()  # their status watch answers this call too, should the replicas fail
        response = self._replica.facts.remote()
        call = asyncio.ensure_future(response)
        unservable = asyncio.ensure_future(self._unservable.wait())
        self._facts_waiting += 1
        try:
            while True:
                await asyncio.wait({call, unservable}, return_when=asyncio.FIRST_COMPLETED)
                if call.done():
                    break
                self._refuse_if_unservable(None)  # the status watch found it unservable
                unservable.cancel()  # not now (a replica is back): wait on, the flag is read again
                await asyncio.wait({call}, timeout=STATUS_MIN_INTERVAL_S)
                unservable = asyncio.ensure_future(self._unservable.wait())
            if isinstance(call.exception(), DeploymentUnavailableError):  # Serve refuses the call: read why
                await self._answer_queued_if_unservable()
                self._refuse_if_unservable(None)
            self._facts = call.result()  # raises the refusal when the status said nothing (or was unread)
            return self._facts
        finally:
            self._facts_waiting -= 1
            unservable.cancel()
            if not call.done():
                call.cancel()
                response.cancel()

    # -- admission and queues -------------------------------------------------------------
    def _cancelled_queued(self, count: int) -> None:
        """Count ``count`` queued requests dropped unrun because their callers left: ``cancelled``
        in ``GET /v1/stats``, ``ditserve_cancelled_queued`` in Prometheus."""
        self._counters["cancelled"] += count
        self._metric_cancelled_queued.inc(count)

    def _admission_limit(self) -> int:
        """Requests held at once, queued or running: ``max_queued_requests`` plus a full batch
        per replica (the bound the Ingress and Serve's proxy enforce in front of the Router)."""
        return admission_limit_of(self._max_queued, self._max_batch_size, self._replica_count() or self._capacity)

    def _admit(self, params: SamplingParams) -> None:
        """Raise ``OverloadedError`` when the queued and running requests reach the admission
        limit (``max_queued_requests`` waiting beyond full batches; for ``priority: batch``,
        ``max_queued_batch_requests``: lowest priority shed first), ``ServiceUnavailableError``
        while no DiTReplica is left and Serve has given up starting one
        (:meth:`_answer_queued_if_unservable`), ``InvalidRequestError`` (400
        ``adapter_refused``) for a LoRA adapter every DiTReplica refused at its last registry
        update (:meth:`_refused_adapters`), counting the rejection."""
        self._trimmer.busy()
        self._refuse_if_unservable(params.request_id)
        refused = sorted({spec.name for spec in params.lora} & self._refused_adapters()) if params.lora else ()
        if refused:
            self._reject("adapter_refused")
            raise InvalidRequestError(f"LoRA adapter {refused[0]!r} was refused by every replica when the adapter "
                                      "registry was updated (why: /v1/stats, the replicas' live_update_refused)",
                                      param=params.adapter_field(refused[0]), code="adapter_refused",
                                      request_id=params.request_id)
        self._refuse_if_unbatchable(params)
        held = self._queued + sum(len(batch) for batch in self._running.values())
        limit = self._admission_limit()
        shed = params.priority == Priority.BATCH  # lowest priority first: its share of the queue is smaller
        queued_limit = self._max_queued_batch if shed else self._max_queued
        if held >= limit - self._max_queued + queued_limit:
            self._reject("overloaded")
            knob = (f"for priority 'batch', max_queued_batch_requests {queued_limit} (the rest of "
                    f"max_queued_requests {self._max_queued} is kept for 'interactive' ones)" if shed
                    else f"max_queued_requests {queued_limit}")
            raise OverloadedError(f"{held} requests are held, queued or running: the admission limit is {knob} "
                                  f"plus a full batch per replica ({limit - self._max_queued}); retry later",
                                  code="overloaded", request_id=params.request_id)

    def _refuse_if_unbatchable(self, params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` (400, counted ``rejected_exceeds_batch``) for a request
        larger than a whole batch: ``n`` past ``max_batch_size``, or pixels × frames × n past
        ``max_batch_cost`` (the knobs in force: a live update may lower them). A batch's first
        request always goes, so such a request ran as an oversized batch, past the bound an
        operator set for the replicas' memory."""
        if params.n > self._max_batch_size:
            self._reject("exceeds_batch")
            raise InvalidRequestError(f"n={params.n} images cannot run in one batch here: batching.max_batch_size is "
                                      f"{self._max_batch_size}; ask for at most {self._max_batch_size}", param="n",
                                      code="invalid_value", request_id=params.request_id)
        cost = request_cost(params)
        if self._max_batch_cost is not None and cost > self._max_batch_cost:
            self._reject("exceeds_batch")
            param, fix = cost_fix(params, self._max_batch_cost)
            raise InvalidRequestError(f"this request is {cost:g} pixels x frames x n (input images included), more than "
                                      f"one batch holds here (batching.max_batch_cost {self._max_batch_cost:g}): "
                                      f"{fix}", param=param, code="invalid_value", request_id=params.request_id)

    async def refused_adapters(self) -> frozenset[str]:
        """The adapters :meth:`_refused_adapters` names (for the Ingress's ``/v1/models``)."""
        return self._refused_adapters()

    def _refused_adapters(self) -> frozenset[str]:
        """The LoRA adapters every DiTReplica refused at its last registry update (a file
        missing or unreadable where they run), as their routing stats last said: requests
        naming one are refused at admission and ``/v1/models`` does not list it."""
        return adapters_refused_everywhere(self._replica.app_name, self._replica.deployment_name)

    def _start_watch(self) -> None:
        """Start the lease / status watch (:meth:`_expire_callers`), once. Raises
        ``RuntimeError`` outside an event loop."""
        if self._watch is None:
            # A fresh context: the tasks outlive the request that happens to start them, and Serve
            # cancels the calls a request made (the batches!) when that request is cancelled.
            self._watch = asyncio.get_running_loop().create_task(self._expire_callers(), context=contextvars.Context())

    def _start_loops(self) -> None:
        """Start the scheduler (on the first call that needs it) and the watch, once each (the
        watch from the start where a loop runs there)."""
        self._start_watch()
        if self._scheduler is None:
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule(), context=contextvars.Context())

    def _refuse_if_unservable(self, request_id: str | None) -> None:
        """Raise (and count) the 503 of a request that comes while the app is being deleted or
        while no DiTReplica is left and Serve gave up starting one, as last read."""
        if self._deleting:
            self._reject("app_deleted")
            raise self._deleted_error(request_id)
        if self._deploy_failed and not self._replica_count():
            self._reject("deploy_failed")
            raise self._deploy_failed_error(request_id)

    def _enqueue(self, params: SamplingParams, on_progress=None, caller: str | None = None,
                 on_preview=None) -> _Pending:
        """Put an admitted request in its signature's queue (no await: admission and queueing
        are one step of the event loop)."""
        self._start_loops()
        signature = BatchSignature.of(params)
        pending = _Pending(params, signature, asyncio.get_running_loop().create_future(), on_progress=on_progress,
                           caller=caller, on_preview=on_preview)
        self._queues.setdefault(signature, deque()).append(pending)
        self._queued += 1
        self._queue_changed(added=(pending,))
        self._wakeup.set()
        return pending

    async def _wait(self, pending: _Pending) -> RequestOutput:
        """The output of an enqueued request; raises its batch's error, or
        ``RequestTimeoutError`` when ``timeout_s`` passes first (it then leaves its queue)."""
        params = pending.params
        try:
            if params.timeout_s is None:
                return await pending.future
            remaining = params.timeout_s - (time.monotonic() - pending.enqueued)
            return await asyncio.wait_for(asyncio.shield(pending.future), max(remaining, 0.0))
        except asyncio.TimeoutError:
            if not self._forget(pending):
                pending.future.cancel()  # in a running batch: that batch may stop early
            self._reject("timeout")
            raise RequestTimeoutError(f"request {params.request_id} did not finish within timeout_s="
                                      f"{params.timeout_s}", param="timeout_s", code="timeout",
                                      request_id=params.request_id) from None
        except asyncio.CancelledError:
            if self._forget(pending):  # the caller went away while queued: never run it
                self._cancelled_queued(1)
            else:  # while its batch runs: when every caller of that batch is gone, it stops early
                pending.future.cancel()
            raise

    async def submit(self, params: SamplingParams, caller: str | None = None) -> RequestOutput:
        """Queue one request and wait for its output. ``caller``: the Ingress replica asking,
        which keeps a lease (:meth:`renew_lease`) while it lives.

        Raises ``OverloadedError`` at once when ``max_queued_requests`` are waiting,
        ``RequestTimeoutError`` when ``params.timeout_s`` passes first, ``InternalError`` if
        its batch fails.
        """
        return await self._wait(self._accept(params, caller))

    def _accept(self, params: SamplingParams, caller: str | None, on_preview=None) -> _Pending:
        """Admit and enqueue a caller's request (``submit``, ``submit_stream``); the submit
        renews the caller's lease."""
        self._admit(params)
        if caller is not None:
            self._reached = self._leases[caller] = time.monotonic()
        return self._enqueue(params, caller=caller, on_preview=on_preview)

    async def submit_stream(self, params: SamplingParams, caller: str | None = None):
        """``submit`` for a request that streams previews: an async generator (called through
        a streaming handle) that yields each preview as its batch makes it
        (``{"preview": {"partial_image_index", "images"}}``), then the RequestOutput. Raises
        as ``submit``; when the caller stops iterating, the request leaves its queue (or its
        running batch, which stops once no request of it is wanted)."""
        previews: asyncio.Queue = asyncio.Queue()
        answer = asyncio.ensure_future(self._wait(self._accept(params, caller, previews.put_nowait)))
        try:
            while not answer.done():
                preview = asyncio.ensure_future(previews.get())
                await asyncio.wait({answer, preview}, return_when=asyncio.FIRST_COMPLETED)
                if preview.done():
                    yield {"preview": preview.result()}
                else:
                    preview.cancel()
            while not previews.empty():
                yield {"preview": previews.get_nowait()}
            yield answer.result()
        finally:
            if not answer.done():
                answer.cancel()

    async def renew_lease(self, caller: str) -> dict:
        """A caller (an Ingress replica) is alive: keep its requests. Returns the admission knobs
        in force, ``{"max_queued_requests", "max_batch_size", "replicas"}`` (a live ``user_config``
        included; ``replicas``: the DiTReplicas routed to now, or ``capacity`` while unknown)."""
        self._reached = self._leases[caller] = time.monotonic()
        return {"max_queued_requests": self._max_queued, "max_batch_size": self._max_batch_size,
                "replicas": self._replica_count() or self._capacity}

    async def wanted_requests(self, batch_id: str, known: list[str] | None = None, wait_s: float = 0.0) -> list[str]:
        """The ids of a running batch's requests that still have a caller (a replica asks while
        it runs the batch, to drop the rows of the others; none: stop it). A Router that
        restarted does not know the batch and answers none.

        A long poll: with ``known`` (the ids the replica last heard), the answer waits until it
        differs from ``known`` or ``wait_s`` seconds pass, so a caller's leaving reaches the
        replica within one call's latency while nothing is sent as long as nobody leaves."""
        def wanted() -> list[str]:
            return sorted(p.params.request_id for p in self._running.get(batch_id, ()) if not p.future.done())

        changed = self._callers_changed.get(batch_id)
        if known is not None and changed is not None:
            changed.clear()  # one replica polls a batch: from here on, only a new change wakes it
            if wanted() != sorted(known):
                return wanted()
            try:
                await asyncio.wait_for(changed.wait(), timeout=max(0.0, min(float(wait_s), 60.0)))
            except asyncio.TimeoutError:
                pass
        return wanted()

    async def _expire_callers(self) -> None:
        """Every second: the requests of callers whose lease ran out are dropped if queued,
        cancelled if running (their batch then stops at a step boundary).

        Leases run out only while some caller still reaches this Router. When none has for a
        whole lease, the Router is the one cut off: Serve stops routing to a replica it is
        stopping (``serve.delete``, a redeploy) before its graceful shutdown, and that shutdown
        lets the running batch finish; expiring every lease then would turn it into a 503.
        With work queued (or dispatched and not yet taken by a replica) while cut off, or while
        the replica set it knew is empty (a delete stops every replica at once; so does a lone
        replica's death, until its replacement, and a redeploy whose new version fails to start;
        a Router the redeploy replaced too never saw a replica: none known is enough),
        it asks whether its app is being deleted or its replicas failed to deploy (also for
        ``model_facts`` calls waiting for a replica)
        (:meth:`_answer_queued_if_unservable`): then that work is answered 503 at once instead of
        when the shutdown's timeout kills it, or never.
        The cost: the requests of a sole Ingress replica that died stay until its replacement
        (or any other caller) renews."""
        while True:
            await asyncio.sleep(1.0)
            self._report_queue_depth()
            now = time.monotonic()
            cut_off = now - self._reached > CALLER_LEASE_S
            waiting = self._queued or self._unstarted or self._facts_waiting
            if self._deploy_failed or (waiting and (cut_off or not self._replica_count())):
                await self._answer_queued_if_unservable()
            if cut_off:
                continue
            gone = {c for c, renewed in self._leases.items() if now - renewed > CALLER_LEASE_S}
            if not gone:
                continue
            for caller in gone:
                del self._leases[caller]
            orphans = [p for q in self._queues.values() for p in q if p.caller in gone]
            orphans += [p for batch in self._running.values() for p in batch if p.caller in gone]
            for p in orphans:
                if self._forget(p):
                    self._cancelled_queued(1)
                if not p.future.done():
                    p.future.cancel()
            if orphans:
                logger.warning("callers %s stopped renewing their lease: %d requests dropped", sorted(gone),
                               len(orphans))

    async def _answer_queued_if_unservable(self) -> None:
        """When this Router's app is being deleted (``serve.status()``: ``DELETING``; also
        ``serve shutdown`` and a config that drops the app), stop dispatching and answer every
        queued request 503 ``unavailable``, and those of batches dispatched that no replica has
        taken yet (their dispatch is cancelled): its replicas are stopping and will take no new
        batch. Running batches still finish. The same when no DiTReplica is left and its
        deployment is ``DEPLOY_FAILED`` (a redeploy whose new version failed to start: Serve
        stopped the old replicas and gives up on the new ones, and its own handles refuse calls
        with ``DeploymentUnavailableError``, which :meth:`_run` meets too); new requests are then
        refused at admission until a replica is back or the status changes (a new deploy: the app
        ``DEPLOYING``), read again every second.
        Waiting ``model_facts`` calls are answered the same way. The status is read by one call
        at a time, at most once a second (others use the last read): in the states
        :meth:`_expire_callers` names, and when Serve refuses a call (``model_facts``, a
        dispatch); a status query that fails or takes over ``STATUS_TIMEOUT_S`` changes nothing
        (the shutdown's timeout still answers)."""
        if self._status_read is None:
            if time.monotonic() - self._status_read_at >= STATUS_MIN_INTERVAL_S:
                self._status_read = asyncio.ensure_future(self._read_status())
        if self._status_read is not None:
            await asyncio.shield(self._status_read)
        if not (self._deleting or self._deploy_failed):
            return
        queued = [p for q in self._queues.values() for p in q]
        for p in queued:
            self._forget(p)
        # dispatched, but no replica took them (they would wait in Serve's handle for one)
        unstarted = [p for batch_id in self._unstarted for p in self._running.get(batch_id, ())]
        for p in queued + unstarted:
            self._answer_unservable(p)
        for dispatch in list(self._unstarted.values()):
            dispatch.cancel()
        if queued or unstarted:
            logger.warning("app %s %s: %d queued and %d dispatched, not started requests answered 503",
                           self._replica.app_name, "is being deleted" if self._deleting else
                           f"has no {self._replica.deployment_name} left (DEPLOY_FAILED)", len(queued), len(unstarted))

    async def _read_status(self) -> None:
        """Read the app's status into ``_deleting`` / ``_deploy_failed`` (see
        :meth:`_answer_queued_if_unservable`); a failed read leaves them as they were."""
        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), STATUS_TIMEOUT_S)
            app = status.applications[self._replica.app_name]
            self._deleting = app.status == ApplicationStatus.DELETING
            replicas = app.deployments.get(self._replica.deployment_name)
            self._deploy_failed = (replicas is not None and replicas.status == DeploymentStatus.DEPLOY_FAILED
                                   and app.status != ApplicationStatus.DEPLOYING and not self._replica_count())
        except Exception as exc:  # the controller is busy or going
            logger.debug("app status unavailable: %s", exc)
        finally:
            if self._deleting or self._deploy_failed:
                self._unservable.set()
            else:
                self._unservable.clear()
            self._status_read, self._status_read_at = None, time.monotonic()

    def _answer_unservable(self, p: _Pending) -> None:
        """Answer ``p`` 503 ``unavailable``, unless it has its answer: its app is being deleted,
        else no DiTReplica can run it (failed to deploy)."""
        if self._deleting:
            self._answer_deleted(p)
        elif not p.future.done():
            self._reject("deploy_failed")
            p.future.set_exception(self._deploy_failed_error(p.params.request_id))

    def _answer_deleted(self, p: _Pending, ran: bool = False) -> None:
        """Answer ``p`` 503 ``unavailable`` (its app is being deleted), unless it has its answer;
        ``ran``: its batch was running when its replica stopped."""
        if not p.future.done():
            self._reject("app_deleted")
            p.future.set_exception(self._deleted_error(p.params.request_id, ran))

    @staticmethod
    def _deleted_error(request_id: str | None, ran: bool = False) -> ServiceUnavailableError:
        """The 503 of a request that arrived or waited while its app is being deleted, or
        (``ran``) whose batch its replica stopped once ``graceful_shutdown_timeout_s`` passed."""
        when = (": this request's batch was stopped while it ran, its replica's graceful_shutdown_timeout_s having "
                "passed" if ran else " before this request ran")
        return ServiceUnavailableError(f"the server is shutting down (its app is being deleted){when}; retry once "
                                       "it is deployed again", code="unavailable", request_id=request_id)

    def _deploy_failed_error(self, request_id: str | None) -> ServiceUnavailableError:
        """The 503 of a request that no replica can run: every one is gone and Serve could not
        start their new version (what failed is in ``serve status``, never in the answer)."""
        return ServiceUnavailableError(
            f"no replica can run this request: the model's replicas ({self._replica.deployment_name}) failed to "
            "deploy and none is left; retry once the app is redeployed", code="unavailable",
            request_id=request_id)

    def _requeue(self, pending: list[_Pending], batch_id: str, cause: BaseException) -> list[_Pending]:
        """Put back, at the head of their queue, the requests of a batch a replica refused (or
        died with) before any step ran; return the ones that used up their ``MAX_REQUEUES``."""
        again = [p for p in pending if not p.future.done() and p.requeues < MAX_REQUEUES]
        for p in reversed(again):
            p.requeues += 1
            self._queues.setdefault(p.signature, deque()).appendleft(p)
        self._queued += len(again)
        self._queue_changed(added=again)
        if again:
            self._counters["requeued"] += len(again)
            self._metric_requeued.inc(len(again))
            logger.warning("batch %s was not run (%s); %d requests requeued", batch_id, type(cause).__name__,
                           len(again))
        return [p for p in pending if p not in again]

    def _forget(self, pending: _Pending) -> bool:
        queue = self._queues.get(pending.signature)
        if queue is None or pending not in queue:
            return False
        queue.remove(pending)
        self._queued -= 1
        self._queue_changed(pending.signature, removed=(pending,))
        return True

    def _queue_changed(self, signature: BatchSignature | None = None, added=(), removed=()) -> None:
        """After requests were ``added`` to or ``removed`` from the queues: drop
        ``signature``'s queue once empty (queues are made per signature a request brings: kept,
        they would grow with every distinct value of a float field) and report the queue depth
        by priority (kept as counts: no pass over the queues)."""
        if signature is not None and not self._queues.get(signature, True):
            del self._queues[signature]
        self._queued_by_priority.update(p.params.priority for p in added)
        self._queued_by_priority.subtract(p.params.priority for p in removed)
        self._report_queue_depth({p.params.priority for p in (*added, *removed)})

    def _report_queue_depth(self, priorities=tuple(Priority)) -> None:
        """Set the queue-depth gauge of ``priorities`` (every one by default: the 1 s watch
        does, since Ray's metrics agent drops a gauge value not set again within two report
        intervals, ``OpenTelemetryMetricRecorder._resolve_gauge_ttl_seconds``: a backlog that
        stood still vanished from the export)."""
        for priority in priorities:
            self._metric_queue_depth.set(self._queued_by_priority[priority], tags={"priority": str(priority)})

    def _reject(self, reason: str) -> None:
        self._counters[f"rejected_{reason}"] += 1
        self._metric_rejections.inc(tags={"reason": reason})

    # -- scheduling ---------------------------------------------------------------------
    def _replica_views(self) -> list[ReplicaView] | None:
        chooser = chooser_for(self._replica.app_name, self._replica.deployment_name)
        views = chooser.replica_views() if chooser is not None else []
        return views or None

    def _replica_count(self) -> int | None:
        """DiTReplicas this Router's handle can route to now (None: its request router not made yet)."""
        return replica_count(self._replica.app_name, self._replica.deployment_name)

    def _replicas_gone(self, count: int | None) -> bool:
        """Whether the DiTReplica set (``count``: :meth:`_replica_count`), non-empty once, is
        empty now (the app is being deleted, or every replica is being replaced)."""
        self._saw_replicas = self._saw_replicas or bool(count)
        return self._saw_replicas and not count

    def _urgent(self, pending: _Pending, now: float) -> bool:
        return is_urgent(pending.params.priority, now - pending.enqueued, self._max_batch_priority_wait_s)

    def _queue_views(self, now: float) -> list[QueueView]:
        views = []
        for sig, q in self._queues.items():
            if q:
                urgent = [now - p.enqueued for p in q if self._urgent(p, now)]
                views.append(QueueView(sig.digest, max(now - p.enqueued for p in q), sum(p.params.n for p in q),
                                       sum(p.cost for p in q), max(urgent) if urgent else None,
                                       frozenset(spec.name for spec in q[0].params.lora)))
        return views

    def _cut(self, digest: str) -> list[_Pending]:
        """The next batch of queue ``digest``: urgent requests first, then the oldest, up to
        ``max_batch_size`` images (and ``max_batch_cost``); the first request always goes."""
        signature, queue = next((s, q) for s, q in self._queues.items() if q and s.digest == digest)
        now = time.monotonic()
        batch, images, cost = [], 0, 0.0
        for p in sorted(queue, key=lambda p: (not self._urgent(p, now), p.enqueued)):
            if batch and (images + p.params.n > self._max_batch_size or (
                    self._max_batch_cost is not None and cost + p.cost > self._max_batch_cost)):
                break
            batch.append(p)
            images, cost = images + p.params.n, cost + p.cost
        taken = {id(p) for p in batch}
        remaining = [p for p in queue if id(p) not in taken]
        queue.clear()
        queue.extend(remaining)
        self._queued -= len(batch)
        self._queue_changed(signature, removed=batch)
        return batch

    async def _schedule(self) -> None:
        while True:
            self._wakeup.clear()
            now = time.monotonic()
            queues = self._queue_views(now)
            replicas = self._replica_views()
            count = self._replica_count()
            gone = self._replicas_gone(count)  # asked on every pass: it also notes that the set was seen
            known = replicas is not None
            if not known and gone:
                # every replica it knew is gone (the app is being deleted, or their replacements are
                # starting): hold the queues, so a batch is not left waiting in the handle for a
                # replica that may never come (a delete answers them 503, _answer_queued_if_unservable)
                replicas = []
            elif not known:  # no chooser's views (affinity off, or start-up): one batch per replica
                replicas = [ReplicaView(str(i), None, i < self._inflight) for i in range(count or self._capacity)]
            else:  # a batch counts against its replica from dispatch on, before Serve routes it
                claimed = set(self._claims.values())
                replicas = [ReplicaView(r.replica_id, r.last_signature, r.busy or r.replica_id in claimed,
                                        r.loaded_loras) for r in replicas]
            decision = choose_queue(
                queues, replicas, max_batch_size=self._max_batch_size, max_wait_s=self._max_wait_s,
                max_affinity_wait_s=self._max_affinity_wait_s, max_batch_cost=self._max_batch_cost,
                affinity=self._affinity, idle_s=None if self._idle_since is None else now - self._idle_since,
                switch_cost_s=self._switch_cost_s,
            ) if queues else None
            if decision is not None and self._inflight < len(replicas) and not self._deleting:
                self._counters[f"routing_{decision.reason}"] += 1
                self._metric_routing.inc(tags={"decision": decision.reason.value})
                self._inflight += 1
                self._idle_since = None
                asyncio.get_running_loop().create_task(
                    self._run(self._cut(decision.signature), decision.replica_id if known else None))
                continue
            timeout = next_wakeup_s(queues, max_wait_s=self._max_wait_s,
                                    max_affinity_wait_s=self._max_affinity_wait_s, switch_cost_s=self._switch_cost_s)
            if queues:
                timeout = REPLICA_POLL_S if timeout is None else min(timeout, REPLICA_POLL_S)
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=timeout)
            except asyncio.TimeoutError:
                pass

    async def _run(self, pending: list[_Pending], replica_id: str | None) -> None:
        dispatched = time.monotonic()
        if all(p.future.done() for p in pending):  # every caller left between the cut and now: run nothing
            self._cancelled_queued(len(pending))
            self._release_slot()
            return
        if self._deleting:  # cut before the app read DELETING, started after: run nothing
            for p in pending:
                self._answer_deleted(p)
            self._release_slot()
            return
        batch = Batch(f"batch-{next(self._batch_ids)}-{uuid.uuid4().hex[:6]}", pending[0].signature,
                      tuple(p.params for p in pending), preferred_replica=replica_id,
                      report_steps=any(p.on_progress is not None for p in pending))
        if replica_id is not None:
            self._claims[batch.batch_id] = replica_id
        self._running[batch.batch_id] = pending
        self._unstarted[batch.batch_id] = asyncio.current_task()
        changed = self._callers_changed[batch.batch_id] = asyncio.Event()
        for p in pending:  # a caller leaving (or an answer) wakes the replica's wanted_requests
            p.future.add_done_callback(lambda _: changed.set())
        self._metric_batch_size.observe(batch.size)
        for p in pending:
            self._metric_queue_wait.observe((dispatched - p.enqueued) * 1e3)
            if p.on_progress is not None:  # dispatched: in progress from here on
                p.on_progress(0, p.params.effective_steps)
        started = False
        try:
            outputs = None
            stream = self._stream.run_batch.remote(batch)
            async for event in stream:
                if isinstance(event, dict) and "preview" in event:  # a streamed request's preview
                    target = next((p for p in pending if p.params.request_id == event["preview"]["request_id"]), None)
                    if target is not None and target.on_preview is not None and not target.future.done():
                        target.on_preview(event["preview"])
                elif isinstance(event, dict) and "cancelled_at" in event:  # the replica heard: no caller left
                    self._count_dropped_rows(pending, event.get("dropped") or {})  # rows that left before it stopped
                    waiting = [p for p in pending if not p.future.done()]
                    if not waiting:
                        saved = event["steps"] - event["cancelled_at"]
                        self._counters["cancelled_running"] += 1
                        self._counters["steps_saved"] += saved
                        self._metric_cancelled.inc(tags={"scope": "batch"})
                        self._metric_steps_saved.inc(saved, tags={"scope": "batch"})
                    for p in waiting:  # it asked another Router (a redeploy's new one), which did not know them
                        self._reject("batch_stopped")
                        p.future.set_exception(ServiceUnavailableError(
                            f"request {p.params.request_id}'s batch was stopped while the router was being "
                            "replaced; retry", code="unavailable", request_id=p.params.request_id))
                    return
                elif isinstance(event, dict) and "dropped" in event:  # the batch failed after these rows left
                    self._count_dropped_rows(pending, event["dropped"])
                elif isinstance(event, dict) and "started" in event:  # the replica began running it
                    started = True
                    self._unstarted.pop(batch.batch_id, None)
                elif isinstance(event, dict):  # {"step": done, "steps": total} (batch.report_steps)
                    for p in pending:
                        if p.on_progress is not None:
                            p.on_progress(event["step"], event["steps"])
                else:
                    outputs = event
            if outputs is None or len(outputs) != len(pending):
                raise RuntimeError(f"replica answered {0 if outputs is None else len(outputs)} outputs "
                                   f"for {len(pending)} requests")
            answered = 0
            for p, out in zip(pending, outputs, strict=True):
                out.timings_ms["queue"] = (dispatched - p.enqueued) * 1e3
                if out.dropped_at_step is not None:  # its caller left while it ran: its rows were dropped
                    self._count_dropped(p, out.dropped_at_step)
                    if not p.future.done():  # cannot happen: dropped only once its caller is gone
                        p.future.set_exception(InternalError(f"request {p.params.request_id} was dropped from "
                                                             "its batch", request_id=p.params.request_id))
                    continue
                if p.future.done():  # its caller left, yet it ran on (Cache-DiT keeps rows; its last steps)
                    self._count_dropped(p, p.params.effective_steps)  # counted, 0 steps saved (helper-59)
                    continue
                if out.error is not None:  # this request alone failed inside the batch
                    self._reject("failed_in_batch")
                    p.future.set_exception(out.error)
                else:
                    p.future.set_result(out)
                    answered += 1
            self._counters["batches"] += 1
            self._counters["requests"] += answered  # not those dropped, timed out or failed in it
            self._metric_batches.inc()
            if answered:
                self._metric_requests.inc(answered)
        except asyncio.CancelledError:  # its app is being deleted and no replica had taken it
            stream.cancel()  # Serve's request too, should a replica have taken it meanwhile
            raise
        except Exception as exc:  # answer every request of the failed batch
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, DeploymentUnavailableError):
                # Serve's handle refuses every call: its app is being deleted, or no DiTReplica is
                # left and Serve gave up starting one. Not requeued (it would be refused again):
                # 503, with the reason the status gives (it also answers the queues)
                self._unstarted.pop(batch.batch_id, None)
                await self._answer_queued_if_unservable()
                for p in pending:
                    self._answer_unservable(p)
                pending = []
            elif isinstance(cause, ReplicaUnavailableError) or (  # the replica says it ran nothing of it
                    not started and isinstance(cause, (RayActorError, ActorUnavailableError))):
                chooser = chooser_for(self._replica.app_name, self._replica.deployment_name)
                if chooser is not None and isinstance(cause, ReplicaUnavailableError):
                    chooser.exclude_replica_of(batch.batch_id)  # never choose it again
                pending = self._requeue(pending, batch.batch_id, cause)
            elif isinstance(cause, (RayActorError, ActorUnavailableError)):  # its replica died while running it
                await self._answer_queued_if_unservable()  # reads whether its app is being deleted
                if self._deleting:  # stopped with its app once the grace passed: a shutdown, not a failure
                    for p in pending:
                        self._answer_deleted(p, ran=True)
                    pending = []
            if pending:
                self._counters["failed_batches"] += 1
                self._metric_failed_batches.inc()
                logger.error("batch %s failed: %s: %s", batch.batch_id, type(cause).__name__, cause)
            for p in pending:
                if p.future.done():
                    continue
                self._reject("batch_failed")
                if isinstance(cause, DitServeError):
                    p.future.set_exception(_for_request(cause, p.params))
                else:
                    p.future.set_exception(InternalError(
                        f"batch {batch.batch_id} failed ({type(cause).__name__}); request {p.params.request_id}",
                        code="batch_failed", request_id=p.params.request_id))
        finally:
            chooser = chooser_for(self._replica.app_name, self._replica.deployment_name)
            if chooser is not None:
                chooser.batch_done(batch.batch_id)
            self._claims.pop(batch.batch_id, None)
            self._running.pop(batch.batch_id, None)
            self._unstarted.pop(batch.batch_id, None)
            self._callers_changed.pop(batch.batch_id).set()
            self._release_slot()

    def _count_dropped_rows(self, pending: list[_Pending], dropped: dict[str, int]) -> None:
        """``_count_dropped`` for each request of ``pending`` named in a replica's ``dropped``
        record (request id -> steps done when its rows left the batch)."""
        for p in pending:
            if p.params.request_id in dropped:
                self._count_dropped(p, dropped[p.params.request_id])

    def _count_dropped(self, p: _Pending, steps_done: int) -> None:
        """Count a request whose caller left while its batch ran, its rows dropped after
        ``steps_done`` steps (all of them when they ran on): ``cancelled_running_requests`` and
        the sample steps it did not run."""
        saved = p.params.n * (p.params.effective_steps - steps_done)
        self._counters["cancelled_running_requests"] += 1
        self._counters["sample_steps_saved"] += saved
        self._metric_cancelled.inc(tags={"scope": "request"})
        if saved:  # Ray's Counter.inc refuses 0
            self._metric_steps_saved.inc(saved, tags={"scope": "request"})

    def _release_slot(self) -> None:
        """A dispatch the scheduler counted in flight has ended: free its slot and wake the scheduler."""
        self._inflight -= 1
        if self._inflight == 0:
            self._idle_since = time.monotonic()
        self._wakeup.set()

    # -- video jobs: admitted and enqueued here, tracked in deployments.jobs ------------------
    async def create_job(self, params: SamplingParams, idempotency: tuple[str, str] | None = None) -> VideoJob:
        """Admit and enqueue a video request as a job and return the job at once
        (``status: queued``). ``idempotency``: ``(scoped Idempotency-Key, request fingerprint)``
        (``deployments.http.idempotency``): while the job a key created is kept, the same key
        returns it instead of a second job (a client's retry after a lost answer). Raises
        ``OverloadedError`` as ``submit``; ``InvalidRequestError`` for a key used for another request."""
        if idempotency is not None and (kept := self._jobs.store.keyed(idempotency)) is not None:
            return kept.view()
        self._admit(params)
        if self._video_previews and not params.partial_images:  # not in the signature: batches alike
            params = dataclasses.replace(params, partial_images=self._video_previews)
        job = self._jobs.store.add(params, idempotency)
        pending = self._enqueue(params, on_progress=job.on_progress, on_preview=job.on_preview)
        return self._jobs.track(job, pending)

    async def list_jobs(self, limit: int, after: str | None, order: ListOrder) -> VideoList:
        """A page of the jobs (``VideoJobs.list``; the Ingress checked ``limit`` and ``order``)."""
        return self._jobs.list(limit, after, order)

    async def get_job(self, job_id: str) -> VideoJob:
        return self._jobs.get(job_id)

    async def job_content(self, job_id: str, variant: str = "video") -> bytes:
        return self._jobs.content(job_id, variant)

    async def delete_job(self, job_id: str) -> dict:
        return self._jobs.delete(job_id)

    # -- observability and lifecycle -----------------------------------------------------
    async def stats(self) -> dict:
        chooser = chooser_for(self._replica.app_name, self._replica.deployment_name)
        return {
            "router_replica": serve.get_replica_context().replica_id.unique_id,
            "max_batch_size": self._max_batch_size,
            "batching": self._batching,  # the knobs in force (args, or the last user_config update)
            "queue_depth": {str(sig): len(q) for sig, q in self._queues.items()},  # none empty
            "queued": self._queued,
            "queued_by_priority": {str(p): self._queued_by_priority[p] for p in Priority},  # the gauge's values
            "inflight_batches": self._inflight,
            "unstarted_batches": len(self._unstarted),  # dispatched, not yet begun by their replica
            "replicas": chooser.replica_stats() if chooser is not None else {},
            "counters": dict(self._counters),
            "live_update_refused": self._live.refused,  # the last user_config update refused, if any
        }

    async def queue_depth(self) -> dict[str, int]:
        """Requests and images (a request counts ``n``) queued here, not yet dispatched: the
        signal DiTReplica autoscales on (``deployments.autoscaling``)."""
        return {"requests": self._queued,
                "images": sum(p.params.n for queue in self._queues.values() for p in queue)}
