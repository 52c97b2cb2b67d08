"""DiTReplica: owns the pipeline of one replica and runs one batch at a time."""

from __future__ import annotations

import asyncio
import os

import torch
from ray import serve

from pipeline.runner import Batch, BatchRunner, ModelFacts, RequestOutput

# Fault injection for chaos tests and drills: a batch whose signature text contains this
# substring fails inside the replica (as a real model error would).
FAULT_ENV = "DITSERVE_FAIL_SIGNATURES_CONTAINING"


@serve.deployment(max_ongoing_requests=1, health_check_period_s=10)
class DiTReplica:
    """Loads the checkpoint at start; ``run_batch`` executes one signature-homogeneous batch.

    ``max_ongoing_requests=1`` makes Serve hand it one batch at a time; the batch runs in a
    worker thread so the actor stays responsive to health checks. It reports the signature
    of its last batch (its acceleration state) to the request router.
    """

    def __init__(self, model: dict, torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self._runner = BatchRunner(**model)
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._lock = asyncio.Lock()
        self._state: str | None = None  # digest of the last batch's signature
        self._batches = 0
        self._state_changes = 0

    def facts(self) -> ModelFacts:
        return self._runner.facts()

    def record_routing_stats(self) -> dict:
        return {"signature": self._state, "batches": self._batches, "state_changes": self._state_changes}

    async def run_batch(self, batch: Batch) -> list[RequestOutput]:
        async with self._lock:
            digest = batch.signature.digest
            state_change = self._state is not None and self._state != digest
            self._state_changes += state_change
            self._state = digest
            self._batches += 1
            fault = os.environ.get(FAULT_ENV)
            if fault and fault in str(batch.signature):
                raise RuntimeError(f"injected fault for signature {batch.signature}")
            outputs = await asyncio.to_thread(self._runner.run, batch)
        for out in outputs:
            out.metadata = {
                "batch_id": batch.batch_id,
                "batch_size": batch.size,
                "signature": str(batch.signature),
                "replica": self._replica_id,
                "world_size": 1,
                "state_change": state_change,
            }
        return outputs
