"""DiTReplica: owns the pipeline of one replica and runs one batch at a time."""

from __future__ import annotations

import asyncio

import torch
from ray import serve

from pipeline.runner import Batch, BatchRunner, ModelFacts, RequestOutput


@serve.deployment(max_ongoing_requests=1, health_check_period_s=10)
class DiTReplica:
    """Loads the checkpoint at start; ``run_batch`` executes one signature-homogeneous batch.

    ``max_ongoing_requests=1`` makes Serve hand it one batch at a time; the batch runs in a
    worker thread so the actor stays responsive to health checks.
    """

    def __init__(self, model: dict, torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self._runner = BatchRunner(**model)
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._lock = asyncio.Lock()

    def facts(self) -> ModelFacts:
        return self._runner.facts()

    async def run_batch(self, batch: Batch) -> list[RequestOutput]:
        async with self._lock:
            outputs = await asyncio.to_thread(self._runner.run, batch)
        for out in outputs:
            out.metadata = {
                "batch_id": batch.batch_id,
                "batch_size": batch.size,
                "signature": str(batch.signature),
                "replica": self._replica_id,
                "world_size": 1,
            }
        return outputs
