"""Sequence sharding of a diffusers transformer: diffusers' own context-parallel hooks.

The model's ``_cp_plan`` says which inputs are split along the sequence and which output is
gathered; ``diffusers.hooks.context_parallel.apply_context_parallel`` installs those hooks.
Attention itself runs through yunchang (see ``parallel.flux`` and ``parallel.wan``).
"""

from __future__ import annotations

import torch

from compat import diffusers as compat
from parallel.config import ParallelConfig

_LAYOUT = "_ditserve_cp"  # our own attribute: the layout the hooks were installed with


def apply_sequence_split(transformer: torch.nn.Module, config: ParallelConfig, mesh, rank: int) -> None:
    """Install the split/gather hooks of the transformer's ``_cp_plan`` for this rank of ``mesh``.
    Raises ``ValueError`` when the transformer has no ``_cp_plan``."""
    cp = compat.context_parallel_config(config.ring_degree, config.ulysses_degree)
    cp.setup(rank, config.world_size, transformer.device, mesh)
    setattr(transformer, _LAYOUT, cp)
    compat.apply_context_parallel(transformer, cp)


class sequence_split_suspended:
    """Context manager: take diffusers' split/gather hooks off while something else rewrites
    ``transformer.forward`` (cache-dit's mount and unmount), then put them back on top, so
    the sequence is split exactly once before whatever forward is current."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer
        self.cp = getattr(transformer, _LAYOUT, None)

    def __enter__(self):
        if self.cp is not None:
            compat.remove_context_parallel(self.transformer)
        return self

    def __exit__(self, *exc):
        if self.cp is not None:
            compat.apply_context_parallel(self.transformer, self.cp)
        return False
