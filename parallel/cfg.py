"""CFG parallelism: the two branches of a guided step on two groups of ranks.

A replica with ``cfg_degree`` 2 is two sequence-parallel groups (``parallel.config``). Per
denoising step (``pipeline.loop.denoise_batch`` calls :meth:`CfgParallel.step`):

- **guided step**: group 0 makes the conditional forward, group 1 the guiding one (negative
  prompt, or the paired second transformer); one all-gather over the ``cfg`` mesh dimension
  gives every rank both predictions, which the loop combines as on one rank (xDiT's CFG
  parallel, arXiv 2411.01738; SGLang and vLLM-Omni do the same);
- **unguided step** (no CFG, or after the CFG gate): the batch's sample rows are split across
  the groups (``torch.tensor_split``: group 0 takes the larger half) and all-gathered; a batch
  of one sample runs on group 0 alone and is broadcast to group 1 (counted as ``lone``);
- **lockstep** (the batch runs Cache-DiT, or the weights are FSDP-sharded across the
  replica): both groups make a forward every step. Unguided steps run whole on both groups
  (group 0's prediction is broadcast), so each group's Cache-DiT context sees every step, and
  after the CFG gate group 1 keeps making its guiding forward, unused; the loop reuses the
  gate's delta exactly as on one rank. Each CFG group decides Cache-DiT for its own branch, as
  one rank decides each branch of a separate-CFG batch: cache-dit's decision statistic is
  reduced over the group's sequence-parallel ranks only (:func:`sequence_parallel_group`,
  ``compat.cache_dit.reduce_decisions_over``). With FSDP-sharded weights every rank gathers
  each block's weights over every rank, so there all ranks keep one decision (cache-dit's
  reduce over the whole process group) and a Cache-DiT batch is not equal to one rank's.

Every rank ends each step with the same predictions, so the scheduler steps agree everywhere
and rank 0 decodes alone. Predictions travel in the dtype ``predict`` returns
(``family.prediction_dtype``: the transformer's, bf16 on GPU, or float32 where the pipeline
upcasts, Z-Image) whatever the latents' (Wan keeps float32 latents), so both ends of every
collective agree on its bytes and guidance sees what one rank's would (helper-72: Z-Image's
float32 predictions went through bf16).
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.distributed as dist


def sequence_parallel_group(config, rank: int):
    """The process group of the ``config.sp_degree`` ranks of ``rank``'s CFG group (None for
    one rank). Every rank of the replica must call it, at the same point: each CFG group's group
    is made on every rank (``torch.distributed.new_group``)."""
    if config.sp_degree == 1:
        return None
    groups = [dist.new_group(list(range(c * config.sp_degree, (c + 1) * config.sp_degree)))
              for c in range(config.cfg_degree)]
    return groups[rank // config.sp_degree]


class CfgStep(str, Enum):
    """How a step ran on a CFG-parallel replica (``/v1/stats``: ``cfg_parallel_<kind>_steps``)."""

    BRANCHES = "branches"  # conditional and guiding forwards on the two groups
    ROWS = "rows"          # the batch's rows split across the groups
    LONE = "lone"          # one sample: group 0 alone, broadcast
    LOCKSTEP = "lockstep"  # both groups run the same forwards (Cache-DiT, sharded weights)


class CfgParallel:
    """One rank's view of CFG parallelism: its CFG group (``cfg_rank`` 0 or 1) and the
    process group of the two ranks that hold the same sequence shard in either CFG group
    (the mesh's ``cfg`` dimension). ``lockstep``: see the module docstring (set per batch)."""

    def __init__(self, group, cfg_rank: int):
        self.group = group
        self.cfg_rank = cfg_rank
        self.source = dist.get_global_rank(group, 0)  # group 0's rank of this pair
        self.lockstep = False
        self.counters = {f"cfg_parallel_{kind.value}_steps": 0 for kind in CfgStep}

    def _count(self, kind: CfgStep) -> None:
        self.counters[f"cfg_parallel_{kind.value}_steps"] += 1

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Group 0's ``tensor`` on both ranks of the pair (same shape and dtype on both)."""
        tensor = tensor.contiguous()
        dist.broadcast(tensor, src=self.source, group=self.group)
        return tensor

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Both ranks' ``tensor`` (same shape on both), group 0's first."""
        tensor = tensor.contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(2)]
        dist.all_gather(pieces, tensor, group=self.group)
        return pieces

    def guide_cached_steps(self, cached: dict[str, int], device) -> dict[str, int]:
        """Group 1's ``cached`` (transformer name -> Cache-DiT cached steps of the last batch, of the
        steps before the CFG gate), on both ranks of the pair. A transformer that makes only
        guiding forwards (paired transformers' ``transformer_2``) runs, and caches, on group 1
        alone, so rank 0 reports group 1's count (its own context never ran: helper-55 saw 0
        where one rank caches 14). ``device``: where the process group's tensors live (CUDA under NCCL)."""
        names = sorted(cached)
        both = self._gather(torch.tensor([cached[name] for name in names], dtype=torch.int64, device=device))
        return dict(zip(names, both[1].tolist(), strict=True))

    def step(self, family, step, guided: bool, latents: torch.Tensor, t: torch.Tensor, cond, guide_cond, guidance,
             positions) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step's predictions ``(cond_pred, guide_pred or None)``, each shaped like
        ``latents`` (B, ...) in ``family.prediction_dtype``, identical on every rank. ``step``: a
        ``pipeline.loop.StepPlan``; ``guided``: the step makes its guiding forward (before the
        CFG gate)."""
        dtype = family.prediction_dtype  # what predict returns: the wire dtype of every collective below
        if guided:
            if self.cfg_rank == 0:
                own = family.predict(latents, t, cond, guidance, positions, model=step.model, branch="cond")
            else:
                own = family.predict(latents, t, guide_cond, guidance, positions, model=step.guide, branch="uncond")
            self._count(CfgStep.BRANCHES)
            cond_pred, guide_pred = self._gather(own.to(dtype))
            return cond_pred, guide_pred
        if self.lockstep:
            if step.guide is not None and self.cfg_rank == 1:  # after the gate: keeps its context in step
                family.predict(latents, t, guide_cond, guidance, positions, model=step.guide, branch="uncond")
                own = torch.empty_like(latents, dtype=dtype)
            else:
                own = family.predict(latents, t, cond, guidance, positions, model=step.model, branch="cond")
            self._count(CfgStep.LOCKSTEP)
            return self._broadcast(own.to(dtype)), None
        batch = latents.shape[0]
        if batch == 1:
            own = torch.empty_like(latents, dtype=dtype)
            if self.cfg_rank == 0:
                own = family.predict(latents, t, cond, guidance, positions, model=step.model, branch="cond")
            self._count(CfgStep.LONE)
            return self._broadcast(own.to(dtype)), None
        halves = torch.tensor_split(torch.arange(batch), 2)
        mine = halves[self.cfg_rank]
        rows = family.predict(latents[mine], t, cond.select(mine), None if guidance is None else guidance[mine],
                              family.select_positions(positions, mine), model=step.model, branch="cond")
        padded = torch.empty_like(latents[:len(halves[0])], dtype=dtype)  # group 0's half is the larger
        padded[:len(mine)] = rows
        first, second = self._gather(padded)
        self._count(CfgStep.ROWS)
        return torch.cat([first[:len(halves[0])], second[:len(halves[1])]]), None
