"""DiTReplica: owns the pipeline of one replica and runs one batch at a time."""

from __future__ import annotations

import asyncio
import logging
import os

import torch
from ray import serve
from ray.exceptions import RayActorError, RayTaskError

from deployments.autoscaling import router_queue_stats
from deployments.rank_worker import RankGroup, make_runner
from parallel.config import ParallelConfig
from pipeline.contract.images import ImageGenerationRequest
from pipeline.contract.videos import VideoGenerationRequest
from pipeline.sampling import AccelerationDefaults, SamplingParams, resolve, resolve_video
from pipeline.signature import BatchSignature
from pipeline.wire import Batch, BatchReport, ModelFacts

# Fault injection for chaos tests and drills: a batch whose signature text contains this
# substring fails inside the replica (as a real model error would).
FAULT_ENV = "DITSERVE_FAIL_SIGNATURES_CONTAINING"


def default_params(model_name: str, acceleration: dict, limits: dict, facts: ModelFacts) -> SamplingParams:
    """The warmup request: the server's default size, frames, steps and acceleration settings."""
    from deployments.config import LimitsConfig

    serving = facts.limits(model_name, LimitsConfig.model_validate(limits).model_dump())
    defaults = AccelerationDefaults.from_config(acceleration)
    if facts.temporal_factor:
        return resolve_video(VideoGenerationRequest(prompt="warmup", seed=0), serving, defaults, request_id="warmup")
    return resolve(ImageGenerationRequest(prompt="warmup", seed=0), serving, defaults, request_id="warmup")


def log_to_serve() -> None:
    """Send the ``ditserve`` loggers' INFO records (the runner's state actions) to this Serve
    replica's log, through Serve's own handlers."""
    ours, serves = logging.getLogger("ditserve"), logging.getLogger("ray.serve")
    ours.setLevel(logging.INFO)
    for handler in serves.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.propagate = False


@serve.deployment(max_ongoing_requests=1, health_check_period_s=10)
class DiTReplica:
    """Loads the checkpoint at start; ``run_batch`` executes one signature-homogeneous batch
    and streams its progress.

    ``max_ongoing_requests=1`` makes Serve hand it one batch at a time; the batch runs in a
    worker thread so the actor stays responsive to health checks. It reports the signature
    of its last batch (its acceleration state) to the request router.
    """

    def __init__(self, model: dict, torch_threads: int | None = None, acceleration: dict | None = None,
                 limits: dict | None = None, parallel: dict | None = None, rank_resources: dict | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        log_to_serve()
        acceleration = acceleration or {}
        self._runner = make_runner(model, acceleration)
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._parallel = ParallelConfig(**(parallel or {}))
        self._max_steps = int((limits or {}).get("max_steps", 100))
        self._ranks = None
        self._broken: str | None = None
        if self._parallel.world_size > 1:
            self._ranks = RankGroup(self._runner, model, acceleration, parallel, torch_threads,
                                    rank_resources or {"CPU": 1}, name_prefix=f"ditserve-{self._replica_id}")
        if acceleration.get("torch_compile") or acceleration.get("warmup"):
            # Mounts Cache-DiT (when it is the default) before torch.compile traces the model.
            head = default_params(model["name"], acceleration, limits or {}, self._runner.facts())
            warmup = Batch("warmup", BatchSignature.of(head), (head,))
            self._runner.run(warmup) if self._ranks is None else self._ranks.run_sync(warmup)
        self._lock = asyncio.Lock()
        self._state: str | None = None  # digest of the last batch's signature
        self._batches = 0
        self._state_changes = 0

    def facts(self) -> ModelFacts:
        return self._runner.facts(ring_degree=self._parallel.ring_degree, max_steps=self._max_steps)

    def check_health(self) -> None:
        """Fails (so Serve replaces the whole replica) if a rank died or a batch broke the group."""
        if self._broken:
            raise RuntimeError(self._broken)
        if self._ranks is not None:
            self._ranks.check_alive()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics, polled only when DiTReplica autoscales: the
        Router's queue (images, requests), which ``RouterQueuePolicy`` scales on."""
        return await router_queue_stats(serve.get_replica_context().app_name)

    def record_routing_stats(self) -> dict:
        return {"signature": self._state, "batches": self._batches, "state_changes": self._state_changes,
                **self._runner.state_report(), **self._runner.counters()}

    async def run_batch(self, batch: Batch):
        """Run one batch; an async generator (called through a streaming handle): yields
        ``{"step": done, "steps": total}`` as denoising steps complete, then the list of
        RequestOutput in batch order. Raises what the model raises."""
        async with self._lock:
            digest = batch.signature.digest
            state_change = self._state is not None and self._state != digest
            self._state_changes += state_change
            self._state = digest
            self._batches += 1
            fault = os.environ.get(FAULT_ENV)
            if fault and fault in str(batch.signature):
                raise RuntimeError(f"injected fault for signature {batch.signature}")
            loop = asyncio.get_running_loop()
            steps: asyncio.Queue = asyncio.Queue()

            def on_step(done: int, total: int) -> None:  # called from the worker thread
                loop.call_soon_threadsafe(steps.put_nowait, {"step": done, "steps": total})

            if self._ranks is None:
                work = asyncio.ensure_future(asyncio.to_thread(self._runner.run, batch, on_step))
            else:
                work = asyncio.ensure_future(self._ranks.run(batch, on_step))
            while not work.done():
                step = asyncio.ensure_future(steps.get())
                await asyncio.wait({work, step}, return_when=asyncio.FIRST_COMPLETED)
                if step.done():
                    yield step.result()
                else:
                    step.cancel()
            while not steps.empty():
                yield steps.get_nowait()
            try:
                outputs = work.result()
            except Exception as exc:
                if self._ranks is not None and (isinstance(exc, (RayActorError, RayTaskError))
                                                or "Connection" in str(exc)):
                    self._broken = f"a rank failed during batch {batch.batch_id}: {type(exc).__name__}"
                raise
        report = BatchReport(batch_id=batch.batch_id, batch_size=batch.size, signature=str(batch.signature),
                             replica=self._replica_id, world_size=self._parallel.world_size,
                             state_change=state_change)
        for out in outputs:
            out.batch = report
        yield outputs
