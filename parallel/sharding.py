"""Sequence sharding of a diffusers transformer: diffusers' own context-parallel hooks.

The model's ``_cp_plan`` says which inputs are split along the sequence and which output is
gathered; ``diffusers.hooks.context_parallel.apply_context_parallel`` installs those hooks.
Attention itself runs through yunchang (see ``parallel.flux`` and ``parallel.wan``).
"""

from __future__ import annotations

import torch

from parallel.config import ParallelConfig


def apply_sequence_split(transformer: torch.nn.Module, config: ParallelConfig, mesh, rank: int) -> None:
    """Install the split/gather hooks of ``transformer._cp_plan`` for this rank of ``mesh``."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig

    cp = ContextParallelConfig(ring_degree=config.ring_degree, ulysses_degree=config.ulysses_degree)
    cp.setup(rank, config.world_size, transformer.device, mesh)
    transformer._ditserve_cp = cp
    apply_context_parallel(transformer, cp, transformer._cp_plan)


class sequence_split_suspended:
    """Context manager: take diffusers' split/gather hooks off while something else rewrites
    ``transformer.forward`` (cache-dit's mount and unmount), then put them back on top, so
    the sequence is split exactly once before whatever forward is current."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer
        self.cp = getattr(transformer, "_ditserve_cp", None)

    def __enter__(self):
        if self.cp is not None:
            from diffusers.hooks.context_parallel import remove_context_parallel

            remove_context_parallel(self.transformer, self.transformer._cp_plan)
        return self

    def __exit__(self, *exc):
        if self.cp is not None:
            from diffusers.hooks.context_parallel import apply_context_parallel

            apply_context_parallel(self.transformer, self.cp, self.transformer._cp_plan)
        return False
