"""DiTReplica: owns the pipeline of one replica and runs one batch at a time."""

from __future__ import annotations

import asyncio
import os

import torch
from ray import serve

from pipeline.accel import freeze_cache_dit_params
from pipeline.contract import ServingLimits, parse_size
from pipeline.runner import Batch, BatchRunner, ModelFacts, RequestOutput
from pipeline.sampling import AccelerationDefaults, SamplingParams, resolve
from pipeline.contract import ImageGenerationRequest

# Fault injection for chaos tests and drills: a batch whose signature text contains this
# substring fails inside the replica (as a real model error would).
FAULT_ENV = "DITSERVE_FAIL_SIGNATURES_CONTAINING"


def default_params(model_name: str, acceleration: dict, limits: dict, guidance_embeds: bool) -> SamplingParams:
    """The warmup request: the server's default size, steps and acceleration settings."""
    width, height = parse_size(limits.get("default_size", "64x64"))
    serving = ServingLimits(model_name, 1, width, height, limits.get("default_steps", 16),
                            limits.get("default_guidance_scale", 3.5), guidance_embeds=guidance_embeds)
    defaults = AccelerationDefaults(acceleration.get("enable_cache_dit", False),
                                    freeze_cache_dit_params(acceleration.get("cache_dit_params")),
                                    acceleration.get("cfg_gate_step", 1.0), acceleration.get("attention_backend"))
    return resolve(ImageGenerationRequest(prompt="warmup", seed=0), serving, defaults, request_id="warmup")


@serve.deployment(max_ongoing_requests=1, health_check_period_s=10)
class DiTReplica:
    """Loads the checkpoint at start; ``run_batch`` executes one signature-homogeneous batch.

    ``max_ongoing_requests=1`` makes Serve hand it one batch at a time; the batch runs in a
    worker thread so the actor stays responsive to health checks. It reports the signature
    of its last batch (its acceleration state) to the request router.
    """

    def __init__(self, model: dict, torch_threads: int | None = None, acceleration: dict | None = None,
                 limits: dict | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        acceleration = acceleration or {}
        self._runner = BatchRunner(**model, attention_backend=acceleration.get("attention_backend"),
                                   torch_compile=acceleration.get("torch_compile", False),
                                   compile_backend=acceleration.get("compile_backend", "inductor"))
        if acceleration.get("torch_compile") or acceleration.get("warmup"):
            self._runner.warmup(default_params(model["name"], acceleration, limits or {},
                                               self._runner.facts().guidance_embeds))
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._lock = asyncio.Lock()
        self._state: str | None = None  # digest of the last batch's signature
        self._batches = 0
        self._state_changes = 0

    def facts(self) -> ModelFacts:
        return self._runner.facts()

    def record_routing_stats(self) -> dict:
        return {"signature": self._state, "batches": self._batches, "state_changes": self._state_changes,
                **self._runner.state(), **self._runner.counters()}

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
