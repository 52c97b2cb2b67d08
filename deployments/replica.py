"""DiTReplica: owns the pipeline of one replica and runs one batch at a time."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time

from ray import serve
from ray.exceptions import ActorDiedError
from ray.serve.metrics import Counter

from deployments.autoscaling import router_queue_stats
from deployments.compute_thread import ComputeThread
from deployments.faults import (RANK_EXIT_ENV, RANK_FAULT_ENV, batch_fault, parse_rank_exit, parse_rank_fault,
                                rank_fault, startup_fault)
from deployments.handles import router_handle
from deployments.live_config import LiveUpdates
from deployments.rank_worker import GroupBroken, RankGroup, make_runner
from deployments.serve_logs import answers_are_not_failures
from parallel.config import ParallelConfig
from pipeline.contract.edits import ImageEditRequest
from pipeline.contract.images import ImageGenerationRequest
from pipeline.contract.videos import VideoGenerationRequest
from pipeline.errors import BatchCancelled, InvalidRequestError, ReplicaUnavailableError, about_adapter, dropped_rows
from pipeline.sampling import AccelerationDefaults, SamplingParams, resolve, resolve_edit, resolve_video
from pipeline.signature import BatchSignature
from pipeline.wire import Batch, BatchReport, ModelFacts

logger = logging.getLogger("ray.serve")
# The replica's cumulative counters (GET /v1/stats, per replica) exported to Prometheus, counted on
# rank 0 (the state a multi-rank replica's ranks keep alike): name -> description
EXPORTED_COUNTERS = {
    "state_changes": "Batches whose signature differed from the replica's previous batch's",
    "mounts": "Cache-DiT mounts", "remounts": "Cache-DiT mounts after an unmount",
    "refreshes": "Cache-DiT refreshes (same key, new steps)", "unmounts": "Cache-DiT unmounts",
    "mount_failures": "Cache-DiT mounts, remounts and unmounts that raised (their batch failed)",
    "attention_switches": "Attention kernel switches", "compiles": "torch.compile builds",
    "offload_moves": "Idle-expert offload moves (a transformer brought to the device)",
    "lora_loads": "LoRA adapter loads on this replica (rank 0)",
    "lora_evictions": "LoRA adapter evictions on this replica (rank 0)",
    "lora_hits": "LoRA adapter hits on this replica (rank 0)",
}
EXIT_DELAY_S = 0.5  # a broken replica exits this long after answering its failing batch
WANTED_POLL_S = 2.0  # the longest a running batch's long poll of its callers waits for a change
WANTED_FIRST_POLL_S = 0.25  # a batch's first long poll waits this long (a shorter batch needs none: RPCs cost CPU)
WANTED_RPC_GRACE_S = 5.0  # beyond that, the time a Router's answer may take before it is asked again
# A batch is not polled once less than this much of its denoising is left (estimated): a poll
# cost the batch 5-40 ms of denoising on 2 shared cores (bench/overhead.py --steps 32, alternated),
# more than dropping rows for the rest of it saves unless callers often leave in its last 0.5 s.
WANTED_MIN_REMAINING_S = 0.5


def worth_polling(steps_done: int, num_steps: int, elapsed_s: float,
                  min_remaining_s: float = WANTED_MIN_REMAINING_S) -> bool:
    """Whether a running batch should (still) ask the Router which of its callers are left.

    ``steps_done``: denoising steps it finished, of ``num_steps`` (the steps that run,
    ``SamplingParams.effective_steps``); ``elapsed_s``: seconds since the replica took it (the
    state transition and text encoding included, which only makes the estimate longer). The
    denoising left is estimated as the mean time per step so far times the steps left; True
    when it is at least ``min_remaining_s`` seconds, and before the first step is done (a
    batch whose first step takes that long is a long one)."""
    if steps_done <= 0:
        return True
    if steps_done >= num_steps:
        return False
    return elapsed_s / steps_done * (num_steps - steps_done) >= min_remaining_s


def grey_png(width: int, height: int) -> bytes:
    """A mid-grey RGB PNG of ``width`` x ``height`` pixels: the image of an edit-only model's
    warmup and default check."""
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(png, "PNG")
    return png.getvalue()


def default_params(model_name: str, acceleration: dict, limits: dict, facts: ModelFacts) -> SamplingParams:
    """The warmup request: the server's default size, frames, steps and acceleration settings
    (a model that only edits, ``facts.requires_image``, warms up on an edit of a grey image).
    Raises ``ValueError`` naming ``acceleration`` when the defaults refuse it (Cache-DiT on by
    default with knobs that cache none of ``limits.default_steps``)."""
    try:
        return _default_params(model_name, acceleration, limits, facts)
    except InvalidRequestError as exc:
        raise ValueError(f"acceleration: the server's defaults (acceleration, limits.default_steps) refuse the "
                         f"warmup request: {exc.message}") from None


def _default_params(model_name: str, acceleration: dict, limits: dict, facts: ModelFacts) -> SamplingParams:
    from deployments.config import LimitsConfig

    serving = facts.limits(model_name, LimitsConfig.model_validate(limits).model_dump())
    defaults = AccelerationDefaults.from_config(acceleration)
    if facts.temporal_factor:
        return resolve_video(VideoGenerationRequest(prompt="warmup", seed=0), serving, defaults, request_id="warmup")
    if facts.requires_image:
        request = ImageEditRequest(prompt="warmup", seed=0, image=grey_png(serving.default_width,
                                                                           serving.default_height))
        return resolve_edit(request, serving, defaults, request_id="warmup")
    return resolve(ImageGenerationRequest(prompt="warmup", seed=0), serving, defaults, request_id="warmup")


def check_defaults(model_name: str, limits: dict, facts: ModelFacts, batching: dict | None = None) -> None:
    """Raise ``ValueError`` naming ``limits.<field>`` when a request giving the server's defaults
    (``default_size``, ``default_steps``, a video's ``default_num_frames``) would be refused: a
    default off the model's grid (``60x64`` where sizes are multiples of 8), or past a limit,
    ran for every request that left the field out. With ``batching`` (``args.batching``), also
    when the Router could batch no such request, or none with ``max_n`` images
    (``deployments.config.batch_fit_problems``, with the model's own frames and input image)."""
    from deployments.config import LimitsConfig, batch_fit_problems, default_refused
    from pipeline.contract.edits import validate_edit_request
    from pipeline.contract.images import validate_image_request
    from pipeline.contract.videos import validate_video_request

    config = LimitsConfig.model_validate(limits)
    serving = facts.limits(model_name, config.model_dump())
    body = {"prompt": "defaults", "size": config.default_size, "num_inference_steps": config.default_steps}
    field = {"size": "default_size", "num_inference_steps": "default_steps", "num_frames": "default_num_frames"}
    try:
        if facts.temporal_factor:
            validate_video_request({**body, "num_frames": config.default_num_frames}, serving)
        elif facts.requires_image:  # an edit of an image of the default size, as the warmup makes
            validate_edit_request({**body, "image": grey_png(serving.default_width, serving.default_height)}, serving)
        else:
            validate_image_request(body, serving)
    except InvalidRequestError as exc:
        raise ValueError(default_refused(field.get(exc.param, exc.param), model_name, exc.message)) from None
    if batching is not None:
        problems = batch_fit_problems(batching, config.model_dump(), facts.temporal_factor > 0,
                                      facts.edits_by_reference_only)
        if problems:
            raise ValueError(f"{'; '.join(problems)} (model {model_name!r})")


def log_to_serve() -> None:
    """Send the ``ditserve`` loggers' INFO records (the runner's state actions) to this Serve
    replica's log, through Serve's own handlers."""
    ours, serves = logging.getLogger("ditserve"), logging.getLogger("ray.serve")
    ours.setLevel(logging.INFO)
    for handler in serves.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.propagate = False


@serve.deployment(max_ongoing_requests=1)
class DiTReplica:
    """Loads the checkpoint at start; ``run_batch`` executes one signature-homogeneous batch
    and streams its events (started, per-step progress when a request shows it, previews).

    ``max_ongoing_requests=1`` makes Serve hand it one batch at a time; the batch runs on the
    replica's one compute thread (``ComputeThread``: all its torch work does) so the actor stays
    responsive to health checks. It reports the signature
    of its last batch (its acceleration state) to the request router.

    A replica whose process group a batch broke (a rank died, or ranks failed differently), or
    whose health check found a rank actor dead, refuses every later batch at once with
    ``ReplicaUnavailableError`` (the Router requeues it), reports itself broken to the request router, stops its rank actors and exits, so
    Serve replaces it at its next health check (``replica.health_check_period_s``, 2 s by
    default) rather than after repeated failed checks.
    """

    def __init__(self, model: dict, torch_threads: int | None = None, acceleration: dict | None = None,
                 limits: dict | None = None, parallel: dict | None = None, rank_resources: dict | None = None,
                 cpu_nice: int = 0, batching: dict | None = None):
        os.nice(cpu_nice)  # compute yields the CPU to the serving path (replica.cpu_nice)
        log_to_serve()
        answers_are_not_failures()  # a refused batch (503 to the Router, which requeues it) is one line
        fault = startup_fault()
        if fault:
            raise RuntimeError(fault)
        parse_rank_fault(os.environ.get(RANK_FAULT_ENV))  # a malformed spec fails the start, not every batch
        parse_rank_exit(os.environ.get(RANK_EXIT_ENV))
        acceleration = acceleration or {}
        model = {**model, "max_loras": int((limits or {}).get("max_loras", 4))}
        self._loras = dict(model.get("loras") or {})  # the registry the runner checked at start
        self._refused_loras: dict[tuple[str, str], str] = {}  # (name, path) -> why a live update refused it
        self._live = LiveUpdates("DiTReplica")
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._parallel = ParallelConfig.of(parallel)
        self._max_steps = int((limits or {}).get("max_steps", 100))
        self._ranks = None
        self._broken: str | None = None
        if self._parallel.world_size > 1:  # ranks 1..N-1 start and load now, while rank 0 imports and loads
            self._ranks = RankGroup(model, acceleration, parallel or {}, torch_threads, rank_resources or {"CPU": 1},
                                    name_prefix=f"ditserve-{self._replica_id}", cpu_nice=cpu_nice)
        # torch is imported there, not at module import, so that the rank actors above start first
        self._compute = ComputeThread("ditserve-compute", torch_threads)
        self._runner = self._compute.call(make_runner, model, acceleration)
        if self._ranks is not None:
            self._ranks.join(self._runner, self._compute)
        self._parameter_bytes = self._ranks.parameter_bytes if self._ranks else [self._runner.parameter_bytes()]
        check_defaults(model["name"], limits or {}, self._runner.facts(), batching)
        if acceleration.get("torch_compile") or acceleration.get("warmup"):
            # Mounts Cache-DiT (when it is the default) before torch.compile traces the model.
            head = default_params(model["name"], acceleration, limits or {}, self._runner.facts())
            warmup = Batch("warmup", BatchSignature.of(head), (head,))
            self._compute.call(self._runner.run, warmup) if self._ranks is None else self._ranks.run_sync(warmup)
        # /v1/stats' replica counters, exported as ray_ditserve_<name>_total (the LoRA ones began so)
        self._metrics = {key: Counter(f"ditserve_{key}", what) for key, what in EXPORTED_COUNTERS.items()}
        self._reported = dict.fromkeys(EXPORTED_COUNTERS, 0)  # counter -> value exported so far
        self._lock = asyncio.Lock()
        self._state: str | None = None  # digest of the last batch's signature
        self._batches = 0
        self._state_changes = 0

    async def reconfigure(self, user_config: dict) -> None:
        """Serve's ``user_config`` hook: ``{"loras": {...}}``, the adapter registry
        (``model.loras``). Adapters new to this replica are checked against the model now (after
        the running batch, which may be changing the model's adapter layers), so a bad one is
        refused by the config update, not found by a request: at start the update raises
        ``ValueError`` naming it (the deploy fails); on a running replica the adapters that fit
        are taken, the others refused (``deployments.live_config``: logged, in ``/v1/stats``), and
        a batch naming one of those is refused with ``InvalidRequestError`` naming it."""
        await self._live.apply(user_config, self._apply_loras)

    async def _apply_loras(self, user_config: dict) -> None:
        from deployments.config import check_user_config_shape, lora_registry

        check_user_config_shape("DiTReplica", user_config or {})
        loras = (user_config or {}).get("loras") or {}
        registry = lora_registry(loras)  # malformed: refused whole, before anything changes
        known = lora_registry(self._loras)
        new = [(n, e.path) for n, e in registry.items() if n not in known or known[n].path != e.path]
        refused = {}
        if new:
            async with self._lock:
                for name, path in new:
                    try:
                        await self._compute.run(self._runner.lora.check, name, path)
                    except ValueError as exc:
                        refused[(name, path)] = str(exc)
        if refused and not self._live.serving:
            raise ValueError("; ".join(refused.values()))
        self._loras = {name: v for name, v in loras.items() if (name, registry[name].path) not in refused}
        self._refused_loras = refused
        if refused:
            raise ValueError("; ".join(refused.values()) + " (requests naming it are refused)")

    def _refuse_refused_adapters(self, batch: Batch) -> None:
        """Raise ``InvalidRequestError`` for a batch naming an adapter this replica refused at
        its last registry update (the Ingress, which cannot load adapters, took the registry)."""
        for spec in batch.requests[0].lora if batch.requests else ():
            reason = self._refused_loras.get((spec.name, spec.path))
            if reason is not None:
                raise about_adapter(InvalidRequestError(f"LoRA adapter {spec.name!r} was refused when the adapter "
                                                        f"registry was updated: {reason}", param="lora",
                                                        code="adapter_refused"), spec.name)

    async def facts(self) -> ModelFacts:
        return self._runner.facts(ring_degree=self._parallel.ring_degree, max_steps=self._max_steps)

    async def check_health(self) -> None:
        """Fails (so Serve replaces the whole replica) if a batch broke the group or a rank is
        dead; ranks answer from their control group, also in the middle of a long batch. The
        first one (right after the start's ``reconfigure``) marks the replica as serving: a bad
        ``user_config`` update is refused from then on (``deployments.live_config``).

        A dead rank actor (``ray.exceptions.ActorDiedError``) found while no batch runs breaks
        the replica at once (:meth:`_break`: it exits, and Serve's next check replaces it), where
        a failed check alone waits for Serve's three in a row
        (``REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD``); while a batch runs, the check only fails,
        so the batch's answer (its requeue, or its outputs) is not cut off by the exit. A
        rank that does not answer within ``RankGroup.check_alive``'s 10 s is left to those three
        checks: a rank slowed by a saturated machine must not cost its replica."""
        self._live.started()
        if self._broken:
            raise RuntimeError(self._broken)
        if self._ranks is not None:
            try:
                await self._ranks.check_alive()
            except ActorDiedError as exc:
                if not self._lock.locked():  # idle: no batch's answer to lose by exiting
                    self._break(f"a rank actor died ({type(exc).__name__}), found by a health check")
                # else the running batch ends first: its own failure breaks the replica, or (the rank
                # died after its part) it answers, and the next check, idle, breaks it
                raise

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics, polled only when DiTReplica autoscales: the
        Router's queue (images, requests), which ``RouterQueuePolicy`` scales on."""
        return await router_queue_stats(serve.get_replica_context().app_name)

    async def record_routing_stats(self) -> dict:
        """What the request router sees of this replica (every ``routing_stats_period_s``): its
        state (signature, adapters loaded and active, kernel, Cache-DiT key), the adapters its
        last registry update refused (``loras_refused``, names) and counters. Also
        exports the :data:`EXPORTED_COUNTERS`' increases since the last call to Prometheus."""
        counters = {"state_changes": self._state_changes, **self._runner.counters()}
        for key, metric in self._metrics.items():
            if counters.get(key, 0) > self._reported[key]:
                metric.inc(counters[key] - self._reported[key])
                self._reported[key] = counters[key]
        return {"signature": self._state, "batches": self._batches,
                "broken": self._broken is not None, "parameter_bytes_per_rank": self._parameter_bytes,
                "live_update_refused": self._live.refused,
                # adapters of the registry this replica refused: the chooser sends their batches elsewhere
                "loras_refused": sorted({name for name, _ in self._refused_loras}),
                "parallel": dataclasses.asdict(self._parallel),
                **self._runner.state_report(), **counters}

    async def _stop_when_unwanted(self, batch: Batch, stop: threading.Event, gone: dict,
                                  steps_done=lambda: 0, started: float | None = None) -> None:
        """While a batch runs, ask the Router which of its requests it still wants (a long poll:
        ``Router.wanted_requests`` answers as soon as a caller leaves); the ids of those it does
        not replace ``gone["ids"]`` (a frozenset the worker thread reads: their rows are dropped
        at the next step boundary); when it wants none (every caller left, or the Router
        that sent it died and a new one does not know it), stop the batch at the next step.
        The first poll waits ``WANTED_FIRST_POLL_S``; no new one starts while less than
        ``WANTED_MIN_REMAINING_S`` of the batch is estimated to be left (:func:`worth_polling`,
        from ``steps_done()`` and the batch's ``started`` time, ``time.monotonic()``): the
        estimate is read again every ``WANTED_FIRST_POLL_S`` (steps may slow down: previews,
        an expert's weights moved in), which costs no call."""
        router = router_handle(serve.get_replica_context().app_name)
        ids = {p.request_id for p in batch.requests}
        known = sorted(ids)
        started = time.monotonic() if started is None else started
        num_steps = batch.requests[0].effective_steps
        await asyncio.sleep(WANTED_FIRST_POLL_S)
        while not stop.is_set():
            if not worth_polling(steps_done(), num_steps, time.monotonic() - started):
                await asyncio.sleep(WANTED_FIRST_POLL_S)  # too little is left for a poll to pay: look again later
                continue
            try:  # a long poll: answered when a caller leaves, or after WANTED_POLL_S
                wanted = await asyncio.wait_for(router.wanted_requests.remote(batch.batch_id, known, WANTED_POLL_S),
                                                WANTED_POLL_S + WANTED_RPC_GRACE_S)
            except Exception:  # noqa: BLE001 - no Router answers yet (restarting): ask again
                await asyncio.sleep(WANTED_POLL_S)
                continue
            known = sorted(wanted)
            if not wanted:
                logger.warning("batch %s has no caller any more; stopping it at the next step", batch.batch_id)
                stop.set()
            elif ids - set(wanted) != gone["ids"]:
                gone["ids"] = frozenset(ids - set(wanted))  # one assignment: the worker thread reads it whole
                logger.info("batch %s: dropping the rows of %s (callers gone)", batch.batch_id, sorted(gone["ids"]))

    def _break(self, reason: str) -> None:
        """Mark the replica unusable, stop its rank actors and exit the process shortly (after
        the failing batch's answer has left), so Serve replaces it at once. Once only: a later
        call (a batch and a health check can both find the group broken) changes nothing."""
        if self._broken:
            return
        self._broken = reason
        logger.error("replica %s is broken: %s; exiting so Serve replaces it", self._replica_id, reason)
        if self._ranks is not None:
            self._ranks.kill()
        asyncio.get_running_loop().call_later(EXIT_DELAY_S, os._exit, 1)

    def _refuse_if_broken(self) -> None:
        if self._broken:
            raise ReplicaUnavailableError(f"replica {self._replica_id} is broken ({self._broken}); the batch was "
                                          "not started", code="replica_broken")

    async def run_batch(self, batch: Batch):
        """Run one batch; an async generator (called through a streaming handle): yields
        ``{"started": batch_id}`` once the replica takes it, ``{"step": done, "steps": total}``
        as denoising steps complete when ``batch.report_steps`` (and ``{"preview": {...}}`` for
        requests that stream previews, ``BatchRunner.run``), then the list of RequestOutput in
        batch order, or ``{"cancelled_at": steps_done, "steps": steps, "dropped": {request_id:
        steps_done}}`` when every caller left and the batch stopped at a step boundary
        (``_stop_when_unwanted``; ``dropped``: the requests whose rows had left it earlier).
        A batch that fails after some rows left it yields ``{"dropped": {request_id: steps_done}}``
        before its error.

        Raises ``ReplicaUnavailableError`` before starting anything when the replica is broken;
        what the model raises otherwise. When the caller cancels the stream, the batch stops at
        the next step boundary (on every rank) and the error is re-raised.
        """
        self._refuse_if_broken()
        self._refuse_refused_adapters(batch)
        async with self._lock:
            self._refuse_if_broken()  # it may have broken while this batch waited for the lock
            digest = batch.signature.digest
            state_change = self._state is not None and self._state != digest
            self._state_changes += state_change
            self._state = digest
            self._batches += 1
            fault = batch_fault(batch)
            if fault:
                raise RuntimeError(fault)
            loop = asyncio.get_running_loop()
            steps: asyncio.Queue = asyncio.Queue()
            stop = threading.Event()

            def on_step(done: int, total: int) -> None:  # called from the worker thread
                loop.call_soon_threadsafe(steps.put_nowait, {"step": done, "steps": total})

            def on_preview(event: dict) -> None:  # likewise: a streamed request's preview
                loop.call_soon_threadsafe(steps.put_nowait, {"preview": event})

            gone = {"ids": frozenset()}
            requests_gone = lambda: gone["ids"]  # noqa: E731 - read from the worker thread
            boundaries = [0]  # step boundaries passed: the loop asks should_stop once per step (rank 0)

            def should_stop() -> bool:  # called from the worker thread
                boundaries[0] += 1
                return stop.is_set()
            progress = on_step if batch.report_steps else None  # step events cost CPU: only when shown
            progress = rank_fault(0, batch, progress)  # a fault injected on rank 0 (deployments.faults)
            steps.put_nowait({"started": batch.batch_id})  # from here on a failure is this batch's, not a refusal
            started = time.monotonic()
            if self._ranks is None:
                work = asyncio.ensure_future(self._compute.run(self._runner.run, batch, progress, should_stop,
                                                               on_preview, requests_gone))
            else:
                work = asyncio.ensure_future(self._ranks.run(batch, progress, should_stop, on_preview, requests_gone))
            watchdog = asyncio.ensure_future(self._stop_when_unwanted(batch, stop, gone, lambda: boundaries[0], started))
            work.add_done_callback(lambda _: watchdog.cancel())
            try:
                while not work.done():
                    step = asyncio.ensure_future(steps.get())
                    await asyncio.wait({work, step}, return_when=asyncio.FIRST_COMPLETED)
                    if step.done():
                        yield step.result()
                    else:
                        step.cancel()
            except (asyncio.CancelledError, GeneratorExit):
                stop.set()  # every caller is gone: stop at the next step boundary, keep the lock until then
                await _settled(work)
                raise
            while not steps.empty():
                yield steps.get_nowait()
            try:
                outputs = work.result()
            except BatchCancelled as exc:  # stopped at a step boundary: every caller had left
                yield {"cancelled_at": exc.steps_done, "steps": exc.steps,
                       "dropped": _by_request_id(batch, exc.dropped)}
                return
            except Exception as exc:  # the batch failed: first name the rows that had left it (counted)
                if isinstance(exc, GroupBroken):
                    self._break(str(exc))
                    if exc.rank_died and boundaries[0] == 0:
                        # A rank was dead before the batch, or died in its first step (rank 0 passes
                        # no step boundary without the others): nothing of the batch ran, so it is
                        # not its failure; the Router requeues it (at most MAX_REQUEUES times) to a
                        # replica that works (a rank killed while the replica idled cost the next
                        # batch a 500)
                        raise ReplicaUnavailableError(
                            f"replica {self._replica_id} is broken ({exc}); the batch was not run",
                            code="replica_broken") from exc
                rows = dropped_rows(exc)
                if rows:
                    yield {"dropped": _by_request_id(batch, rows)}
                raise
        report = BatchReport(batch_id=batch.batch_id, batch_size=batch.size, signature=str(batch.signature),
                             replica=self._replica_id, world_size=self._parallel.world_size,
                             state_change=state_change)
        for out in outputs:
            out.batch = report
        yield outputs


def _by_request_id(batch: Batch, rows: dict[int, int]) -> dict[str, int]:
    """Dropped rows (batch index -> steps done) keyed by request id, as the Router counts them."""
    return {batch.requests[i].request_id: step for i, step in rows.items()}


async def _settled(work: asyncio.Future) -> None:
    """Wait for ``work`` to end, whatever it ends with (used after a cancellation)."""
    try:
        await asyncio.shield(work)
    except BaseException:  # noqa: BLE001 - its outcome no longer has a caller
        pass
