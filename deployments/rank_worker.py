"""Rank workers of a multi-rank replica: Ray actors pinned to the replica's placement group.

The DiTReplica actor is rank 0; it starts ranks 1..N-1 here, each in its own bundle of the
replica's placement group (so they are owned by, and die with, the replica). Start-up order:
the rank actors are created first and load their model while rank 0 loads its own; once every
rank has loaded, all join one torch.distributed group (the rendezvous waits only for joining,
``parallel.rendezvous_timeout_s``). Per batch every rank runs the same steps on its shard of
the sequence; only rank 0 decodes.

Failures: a batch that fails on any rank, other than the same state-transition failure on
every rank before any collective or a failure rank 0 shares with every rank (``SharedFailure``),
leaves the group unusable (ranks may be blocked in a
collective); :class:`RankGroup` reports it as :class:`GroupBroken` and the replica is replaced.
"""

from __future__ import annotations

import asyncio
import os

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.compute_thread import ComputeThread
from deployments.faults import rank_exit, rank_fault
from parallel.config import ParallelConfig
from parallel.groups import free_port, join
from pipeline.errors import BatchCancelled, LoraLoadError, SharedFailure, dropped_rows, record_dropped_rows
from pipeline.state import StateTransitionError
from pipeline.wire import Batch

# Light at import (no torch, no model code): rank 0 creates its rank actors before it imports
# and loads its own model, so every rank's process starts and loads at the same time.

# Seconds the other ranks get to end the same consistent way as the first rank that stopped
# before the group is declared broken.
SAME_FAILURE_GRACE_S = 30.0
# After a rank failed in a batch, how long the other ranks' pings may take to tell a dead one
# (a rank whose process exited makes its peers' collectives fail first, as a RuntimeError)
DEAD_RANK_PING_S = 2.0
# Ways a batch can end on every rank that leave the ranks in step.
CONSISTENT = (StateTransitionError, BatchCancelled, SharedFailure, LoraLoadError)


def rank_device(configured: str, gpu_ids: list, cuda_visible_set_by_ray: bool) -> str:
    """The device a rank runs on: ``configured`` for CPU; on CUDA the rank's own GPU — index 0
    when Ray narrowed ``CUDA_VISIBLE_DEVICES`` to it, else the GPU id Ray assigned
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``), so ranks never share GPU 0 by accident."""
    if not configured.startswith("cuda") or not gpu_ids:
        return configured
    return "cuda:0" if cuda_visible_set_by_ray else f"cuda:{int(gpu_ids[0])}"


def make_runner(model: dict, acceleration: dict, rank: int = 0):
    """This process's ``pipeline.runner.BatchRunner``, on this rank's device (see
    :func:`rank_device`); ranks other than 0 load the transformers alone (rank 0 encodes the
    prompts for every rank and decodes alone, unless ``model.vae.tiling`` has every rank load the
    VAE to share the tiled decode: ``parallel.vae``). ``model``: ``ModelConfig`` as a dict, plus
    ``max_loras`` (the hot-swap slots under torch.compile)."""
    from deployments.config import lora_registry
    from pipeline.runner import BatchRunner

    model = dict(model)
    vae = model.pop("vae", None) or {}
    model["vae_slicing"], model["vae_tiling"] = bool(vae.get("slicing")), bool(vae.get("tiling"))
    model["device"] = rank_device(model.get("device", "cpu"), ray.get_gpu_ids() if ray.is_initialized() else [],
                                  not os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"))
    model["loras"] = {name: entry.path for name, entry in lora_registry(model.get("loras") or {}).items()}
    return BatchRunner(**model, attention_backend=acceleration.get("attention_backend"),
                       torch_compile=acceleration.get("torch_compile", False),
                       compile_backend=acceleration.get("compile_backend", "inductor"),
                       components="all" if rank == 0 else "denoiser+vae" if model["vae_tiling"] else "denoiser")


def layout_problems_before_loading(model: dict, config: ParallelConfig) -> list[str]:
    """What the checkpoint's ``transformer/config.json`` alone says ``config`` cannot serve
    (its attention heads, ``pipeline.families.checkpoint_attention_heads``), before anything is
    loaded; empty when nothing is known yet (a checkpoint this node does not have, not a
    diffusers directory, a config without the key): rank 0 checks the loaded model again in
    :meth:`RankGroup.join`. A hub id is read from its snapshot in this node's Hugging Face
    cache, as loading reads it. ``model``: ``ModelConfig`` as a dict. Raises
    ``FileNotFoundError`` for an unknown embedded name without a path
    (``pipeline.tiny.registry.resolve_checkpoint``)."""
    from pipeline.families import checkpoint_attention_heads
    from pipeline.tiny.registry import resolve_checkpoint

    if model.get("path"):  # a configured checkpoint: a directory, or a hub id in the local cache
        try:
            checkpoint = resolve_checkpoint(model["name"], model["path"])
        except FileNotFoundError:
            return []  # loading refuses it, naming model.path
    else:  # an embedded tiny model, built on first use (rank 0 would build it now anyway)
        checkpoint = resolve_checkpoint(model["name"], None)
    heads = checkpoint_attention_heads(checkpoint)
    return [] if heads is None else config.startup_problems(num_heads=heads)


class GroupBroken(RuntimeError):
    """A batch left the replica's process group unusable: a rank died, or ranks failed
    differently (some may be blocked in a collective). The replica must be replaced.
    ``rank_died``: a rank's actor was dead (``RayActorError``: killed, its process or node
    lost), not an error a batch raised: the failing rank's, or one :meth:`RankGroup.dead_ranks`
    found dead after another rank failed (a rank whose process exits makes rank 0's next
    collective fail first, with gloo's or NCCL's own error)."""

    rank_died: bool = False


@ray.remote(concurrency_groups={"batch": 1, "control": 1})
class RankWorker:
    """Rank ``rank`` (>= 1) of one replica: its own model copy and acceleration state.

    Two concurrency groups: batches run one at a time in ``batch``; ``ping`` and
    ``cache_stats`` answer in ``control`` while a batch runs, so a long batch never fails
    the replica's health check.
    """

    def __init__(self, rank: int, model: dict, acceleration: dict, parallel: dict, torch_threads: int | None,
                 cpu_nice: int = 0):
        os.nice(cpu_nice)
        self.rank = rank
        self.config = ParallelConfig.of(parallel)
        # all torch work on one thread (the constructor and the concurrency groups run on others)
        self.compute = ComputeThread(f"ditserve-rank{rank}", torch_threads)
        self.runner = self.compute.call(make_runner, model, acceleration, rank)

    @ray.method(concurrency_group="control")
    def ready(self) -> int:
        """Returns once the model is loaded (the actor's constructor has finished): the bytes
        of the weights this rank holds."""
        return self.runner.parameter_bytes()

    @ray.method(concurrency_group="batch")
    def join(self, master_addr: str, master_port: int, timeout_s: float = 600.0) -> int:
        def joined() -> None:
            mesh = join(self.rank, self.config, master_addr, master_port, str(self.runner.family.device), timeout_s)
            self.runner.enable_parallel(self.config, mesh, self.rank)

        self.compute.call(joined)
        return self.rank

    @ray.method(concurrency_group="batch")
    def run_batch(self, batch: Batch) -> list:
        """``BatchRunner.run`` on this rank: the RequestOutputs on rank 0 (a replica's rank 0 runs
        in its own process, so the actors' answer is empty), none elsewhere."""
        if rank_exit(self.rank, batch):  # fault injection (deployments.faults): this process dies
            os._exit(1)
        # stops when rank 0 says so
        return self.compute.call(self.runner.run, batch, on_step=rank_fault(self.rank, batch))

    @ray.method(concurrency_group="batch")
    def denoise(self, batch: Batch):
        return self.compute.call(self.runner.denoise, batch)

    @ray.method(concurrency_group="control")
    def counters(self) -> dict:
        """This rank's cumulative counters (``BatchRunner.counters``)."""
        return self.runner.counters()

    @ray.method(concurrency_group="control")
    def cache_stats(self) -> dict:
        """This rank's cache-dit record of the last batch: cached steps and residual diffs."""
        import cache_dit

        stats = cache_dit.summary(self.runner.family.transformers["transformer"], logging=False) or []
        return {"cached_steps": list(stats[0].cached_steps) if stats else [],
                "residual_diffs": dict(stats[0].residual_diffs) if stats else {}}

    @ray.method(concurrency_group="control")
    def ping(self) -> bool:
        return True


class RankGroup:
    """Rank 0's view of its replica: its own runner plus the worker actors of ranks 1..N-1."""

    def __init__(self, model: dict, acceleration: dict, parallel: dict, torch_threads: int | None,
                 rank_resources: dict, name_prefix: str, cpu_nice: int = 0):
        """Create the rank actors (they start loading at once). Raises ``ValueError`` when the
        placement group does not have one bundle per rank, or when the checkpoint's transformer
        config already rules the layout out (:func:`layout_problems_before_loading`, read while
        the actors start): then they are stopped at once, and each of Serve's retries of the
        constructor fails in seconds, not after every rank has loaded the model."""
        self.config = ParallelConfig.of(parallel)
        self.rendezvous_timeout_s = float(parallel.get("rendezvous_timeout_s", 600.0))
        pg = ray.util.get_current_placement_group()
        if pg is None or len(pg.bundle_specs) != self.config.world_size:
            raise ValueError(f"world_size={self.config.world_size} needs one placement-group bundle per rank "
                             f"(DiTReplica's placement_group_bundles, built from replica.rank_resources); the replica "
                             f"has {0 if pg is None else len(pg.bundle_specs)}")
        self.workers = [
            RankWorker.options(
                name=f"{name_prefix}-rank{rank}",
                num_cpus=rank_resources.get("CPU", 1), num_gpus=rank_resources.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(rank, model, acceleration, parallel, torch_threads, cpu_nice)
            for rank in range(1, self.config.world_size)
        ]
        problems = layout_problems_before_loading(model, self.config)
        if problems:
            self.kill()
            raise ValueError("bad parallel layout: " + "; ".join(problems))
        self.runner = None  # rank 0's BatchRunner, once joined
        self.compute = None  # rank 0's ComputeThread, once joined
        self.parameter_bytes: list[int] = []  # per rank, once joined

    def join(self, runner, compute: ComputeThread) -> None:
        """Wait until every rank has loaded, then form the process group with rank 0's ``runner``,
        whose torch work runs on ``compute`` (not the calling thread). Raises ``ValueError``
        for a layout the model cannot take; the rendezvous raises after ``rendezvous_timeout_s``."""
        problems = self.config.startup_problems(num_heads=runner.family.num_attention_heads)
        if problems:
            raise ValueError("bad parallel layout: " + "; ".join(problems))
        runner.check_default_kernel(self.config.ring_degree)  # before waiting for the other ranks
        loaded = ray.get([w.ready.remote() for w in self.workers])  # loading takes as long as it takes
        self.parameter_bytes = [runner.parameter_bytes(), *loaded]
        address, port = ray.util.get_node_ip_address(), free_port()
        joined = [w.join.remote(address, port, self.rendezvous_timeout_s) for w in self.workers]

        def join_rank0() -> None:
            mesh = join(0, self.config, address, port, str(runner.family.device), self.rendezvous_timeout_s)
            runner.enable_parallel(self.config, mesh, 0)

        compute.call(join_rank0)
        ray.get(joined)
        if self.config.shard_weights:  # each rank now holds its shards only
            self.parameter_bytes = [runner.parameter_bytes(), *ray.get([w.ready.remote() for w in self.workers])]
        self.runner, self.compute = runner, compute

    async def run(self, batch: Batch, on_step=None, should_stop=None, on_preview=None, requests_gone=None):
        """Run ``batch`` on every rank; rank 0's outputs (``on_step`` follows rank 0's steps).

        Raises rank 0's error when every rank ended the same consistent way (the same failed
        state transition, before any collective; or a cancellation agreed at the same step),
        else :class:`GroupBroken` as soon as any rank fails (others may be blocked in a
        collective; they are not waited for).
        """
        rank0 = asyncio.ensure_future(self.compute.run(self.runner.run, batch, on_step, should_stop, on_preview,
                                                       requests_gone))
        others = [asyncio.ensure_future(_awaited(w.run_batch.remote(batch))) for w in self.workers]
        tasks = [rank0, *others]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if not failed:
            return rank0.result()
        first = failed[0].exception()
        if isinstance(_cause(first), CONSISTENT):  # still in step only if every rank ended the same way
            await asyncio.wait(tasks, timeout=SAME_FAILURE_GRACE_S)
            kind = type(_cause(first))
            if all(t.done() and isinstance(_cause(t.exception()), kind) for t in tasks):
                raise _cause(rank0.exception())
        rank = 0 if failed[0] is rank0 else tasks.index(failed[0])
        died = [rank] if isinstance(_cause(first), ray.exceptions.RayActorError) else await self.dead_ranks()
        broken = GroupBroken(f"rank {rank} failed during batch {batch.batch_id}: {type(_cause(first)).__name__}: "
                             f"{str(_cause(first))[:200]}" + (f" (rank {died[0]} is dead)" if died and died != [rank]
                                                              else ""))
        broken.rank_died = bool(died)
        if rank0.done() and rank0.exception() is not None:  # rows rank 0 had dropped before it failed
            record_dropped_rows(broken, dropped_rows(rank0.exception()))
        raise broken

    def run_sync(self, batch: Batch):
        """``run`` for the replica's constructor (warmup), outside any event loop."""
        pending = [w.run_batch.remote(batch) for w in self.workers]
        outputs = self.compute.call(self.runner.run, batch)
        ray.get(pending)
        return outputs

    async def dead_ranks(self, timeout_s: float = DEAD_RANK_PING_S) -> list[int]:
        """The ranks (1..N-1) whose actor is dead (``ray.exceptions.ActorDiedError`` to a ping
        within ``timeout_s``); one that is alive answers from its control group, even while
        blocked in a collective, and one that does not answer in time is not counted."""
        answers = await asyncio.gather(*[asyncio.wait_for(_awaited(w.ping.remote()), timeout_s) for w in self.workers],
                                       return_exceptions=True)
        return [rank for rank, answer in enumerate(answers, start=1) if isinstance(answer, ray.exceptions.ActorDiedError)]

    async def check_alive(self, timeout_s: float = 10.0) -> None:
        """Raises if any rank worker is dead or does not answer within ``timeout_s`` (answered
        from its control group, also while a batch runs)."""
        await asyncio.wait_for(asyncio.gather(*[_awaited(w.ping.remote()) for w in self.workers]), timeout_s)

    def kill(self) -> None:
        """Stop every rank actor (the replica is being replaced)."""
        for w in self.workers:
            ray.kill(w, no_restart=True)


async def _awaited(ref):
    return await ref


def _cause(exc: BaseException | None) -> BaseException | None:
    """The original exception of a Ray task error (``RayTaskError.cause``)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc
