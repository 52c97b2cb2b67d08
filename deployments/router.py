"""Router: one FIFO queue per batch signature; forms batches and hands them to replicas.

It decides what runs next and never touches a tensor. A batch is formed only when a
replica can take it (late binding): then the oldest queue that is full
(``max_batch_size`` images) or whose head has waited ``max_wait_ms`` is cut into a batch.
Every accepted request gets exactly one answer: its output, or an error.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from ray import serve

from pipeline.errors import DitServeError, InternalError, OverloadedError
from pipeline.runner import Batch, ModelFacts, RequestOutput
from pipeline.sampling import SamplingParams
from pipeline.signature import BatchSignature

logger = logging.getLogger("ray.serve")


@dataclass(eq=False)
class _Pending:
    params: SamplingParams
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


@serve.deployment(num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
class Router:
    """``capacity``: batches that may run at once (one per DiTReplica replica)."""

    def __init__(self, replica, batching: dict, capacity: int):
        self._replica = replica
        self._max_batch_size = int(batching["max_batch_size"])
        self._max_wait_s = float(batching["max_wait_ms"]) / 1e3
        self._max_queued = int(batching["max_queued_requests"])
        self._capacity = capacity
        self._queues: dict[BatchSignature, deque[_Pending]] = {}
        self._queued = 0
        self._inflight = 0
        self._wakeup = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        self._facts: ModelFacts | None = None
        self._batch_ids = itertools.count()
        self._stats = {"batches": 0, "requests": 0, "failed_batches": 0, "rejected_overloaded": 0}

    async def model_facts(self) -> ModelFacts:
        if self._facts is None:
            self._facts = await self._replica.facts.remote()
        return self._facts

    async def submit(self, params: SamplingParams) -> RequestOutput:
        """Queue one request and wait for its output. Raises ``OverloadedError`` at once when
        ``max_queued_requests`` are waiting, ``InternalError`` if its batch fails."""
        if self._scheduler is None:
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule())
        if self._queued >= self._max_queued:
            self._stats["rejected_overloaded"] += 1
            raise OverloadedError(f"{self._queued} requests are queued (max_queued_requests); retry later",
                                  code="overloaded", request_id=params.request_id)
        pending = _Pending(params, asyncio.get_running_loop().create_future())
        self._queues.setdefault(BatchSignature.of(params), deque()).append(pending)
        self._queued += 1
        self._wakeup.set()
        try:
            return await pending.future
        except asyncio.CancelledError:
            self._forget(pending)  # the caller went away: never run it
            raise

    def _forget(self, pending: _Pending) -> None:
        queue = self._queues.get(BatchSignature.of(pending.params))
        if queue is not None and pending in queue:
            queue.remove(pending)
            self._queued -= 1

    def stats(self) -> dict:
        return {
            "queue_depth": {str(sig): len(q) for sig, q in self._queues.items() if q},
            "queued": self._queued,
            "inflight_batches": self._inflight,
            "counters": dict(self._stats),
        }

    # -- scheduling ---------------------------------------------------------------------
    def _next_batch(self, now: float) -> tuple[list[_Pending], float | None]:
        """The batch to dispatch now (oldest ready queue first), or the seconds until one is due."""
        ready, due = None, None
        for queue in self._queues.values():
            if not queue:
                continue
            head_age = now - queue[0].enqueued
            full = sum(p.params.n for p in queue) >= self._max_batch_size
            if full or head_age >= self._max_wait_s:
                if ready is None or queue[0].enqueued < ready[0].enqueued:
                    ready = queue
            else:
                wait = self._max_wait_s - head_age
                due = wait if due is None else min(due, wait)
        if ready is None:
            return [], due
        batch = [ready.popleft()]
        images = batch[0].params.n
        while ready and images + ready[0].params.n <= self._max_batch_size:
            images += ready[0].params.n
            batch.append(ready.popleft())
        self._queued -= len(batch)
        return batch, None

    async def _schedule(self) -> None:
        while True:
            self._wakeup.clear()
            due = None
            if self._inflight < self._capacity:
                batch, due = self._next_batch(time.monotonic())
                if batch:
                    self._inflight += 1
                    asyncio.get_running_loop().create_task(self._run(batch))
                    continue
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=due)
            except asyncio.TimeoutError:
                pass

    async def _run(self, pending: list[_Pending]) -> None:
        dispatched = time.monotonic()
        params = tuple(p.params for p in pending)
        batch = Batch(f"batch-{next(self._batch_ids)}-{uuid.uuid4().hex[:6]}", BatchSignature.of(params[0]), params)
        try:
            outputs = await self._replica.run_batch.remote(batch)
            for p, out in zip(pending, outputs):
                out.timings_ms["queue"] = (dispatched - p.enqueued) * 1e3
                if not p.future.done():
                    p.future.set_result(out)
            self._stats["batches"] += 1
            self._stats["requests"] += len(pending)
        except Exception as exc:  # answer every request of the failed batch
            self._stats["failed_batches"] += 1
            cause = getattr(exc, "cause", exc)
            logger.error("batch %s failed: %r", batch.batch_id, cause)
            for p in pending:
                if p.future.done():
                    continue
                if isinstance(cause, DitServeError):
                    p.future.set_exception(cause)
                else:
                    p.future.set_exception(InternalError(
                        f"batch {batch.batch_id} failed ({type(cause).__name__}); request {p.params.request_id}",
                        code="batch_failed", request_id=p.params.request_id))
        finally:
            self._inflight -= 1
            self._wakeup.set()
