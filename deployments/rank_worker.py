"""Rank workers of a multi-rank replica: Ray actors pinned to the replica's placement group.

The DiTReplica actor is rank 0; it starts ranks 1..N-1 here, each in its own bundle of the
replica's placement group (so they are owned by, and die with, the replica), and all ranks
join one torch.distributed group. Per batch every rank runs the same steps on its shard of
the sequence; only rank 0 decodes.
"""

from __future__ import annotations

import asyncio

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from parallel.config import ParallelConfig
from parallel.groups import free_port, join
from pipeline.runner import BatchRunner
from pipeline.wire import Batch


def make_runner(model: dict, acceleration: dict) -> BatchRunner:
    return BatchRunner(**model, attention_backend=acceleration.get("attention_backend"),
                       torch_compile=acceleration.get("torch_compile", False),
                       compile_backend=acceleration.get("compile_backend", "inductor"))


@ray.remote
class RankWorker:
    """Rank ``rank`` (>= 1) of one replica: its own model copy and acceleration state."""

    def __init__(self, rank: int, model: dict, acceleration: dict, parallel: dict, torch_threads: int | None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.rank = rank
        self.config = ParallelConfig(**parallel)
        self.runner = make_runner(model, acceleration)

    def join(self, master_addr: str, master_port: int) -> int:
        mesh = join(self.rank, self.config, master_addr, master_port, str(self.runner.family.device))
        self.runner.enable_sequence_parallel(self.config, mesh, self.rank)
        return self.rank

    def run_batch(self, batch: Batch) -> None:
        self.runner.run(batch)

    def denoise(self, batch: Batch):
        return self.runner.denoise(batch)

    def cache_stats(self) -> dict:
        """This rank's cache-dit record of the last batch: cached steps and residual diffs."""
        import cache_dit

        stats = cache_dit.summary(self.runner.family.transformers["transformer"], logging=False) or []
        return {"cached_steps": list(stats[0].cached_steps) if stats else [],
                "residual_diffs": dict(stats[0].residual_diffs) if stats else {}}

    def ping(self) -> bool:
        return True


class RankGroup:
    """Rank 0's view of its replica: its own runner plus the worker actors of ranks 1..N-1."""

    def __init__(self, runner: BatchRunner, model: dict, acceleration: dict, parallel: dict,
                 torch_threads: int | None, rank_resources: dict, name_prefix: str):
        self.runner = runner
        self.config = ParallelConfig(**parallel)
        problems = self.config.startup_problems(num_heads=runner.family.num_attention_heads)
        if problems:
            raise ValueError("bad parallel layout: " + "; ".join(problems))
        pg = ray.util.get_current_placement_group()
        if pg is None or len(pg.bundle_specs) != self.config.world_size:
            raise ValueError(f"world_size={self.config.world_size} needs one placement-group bundle per rank; "
                             f"the replica has {0 if pg is None else len(pg.bundle_specs)}")
        self.workers = [
            RankWorker.options(
                name=f"{name_prefix}-rank{rank}",
                num_cpus=rank_resources.get("CPU", 1), num_gpus=rank_resources.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(rank, model, acceleration, parallel, torch_threads)
            for rank in range(1, self.config.world_size)
        ]
        address = ray.util.get_node_ip_address()
        port = free_port()
        joined = [w.join.remote(address, port) for w in self.workers]
        mesh = join(0, self.config, address, port, str(runner.family.device))
        ray.get(joined)
        runner.enable_sequence_parallel(self.config, mesh, 0)

    async def run(self, batch: Batch, on_step=None):
        """Run ``batch`` on every rank; rank 0's outputs (``on_step`` follows rank 0's steps).
        A failed rank fails the batch."""
        pending = [w.run_batch.remote(batch) for w in self.workers]
        outputs, *_ = await asyncio.gather(asyncio.to_thread(self.runner.run, batch, on_step), *pending)
        return outputs

    def run_sync(self, batch: Batch):
        """``run`` for the replica's constructor (warmup), outside any event loop."""
        pending = [w.run_batch.remote(batch) for w in self.workers]
        outputs = self.runner.run(batch)
        ray.get(pending)
        return outputs

    def check_alive(self, timeout_s: float = 10.0) -> None:
        """Raises if any rank worker is dead or unresponsive."""
        ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)
