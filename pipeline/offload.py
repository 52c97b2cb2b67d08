"""Weights that do not all fit on the device: the idle expert, or diffusers' group offloading.

``model.offload`` (``deployments.config.ModelConfig``):

- ``none``: every transformer stays on the device.
- ``idle_expert``: boundary-expert models (Wan 2.2 A14B: ``transformer`` above the boundary
  timestep, ``transformer_2`` below it) keep only the expert that runs on the device; the other
  waits in host memory and is moved in when a step needs it (once per batch at the boundary,
  and back at the next batch's first step). Saves one expert's bytes (≈ 28 GB in bf16 for
  A14B) at the cost of two host↔device copies per batch (measured by ``bench/gpu/check.py``).
- ``group``: diffusers' ``apply_group_offloading`` on every transformer (block level, one block
  per group, a CUDA stream prefetching the next block on GPU): weights live in host memory and
  each block is copied in just before it runs — for GPUs too small for one transformer.

Both move weights only; the computation is the same, so outputs equal ``none`` exactly.
"""

from __future__ import annotations

import torch

from pipeline.modes import OFFLOAD_MODES, OffloadMode, offload_problems


HOST = torch.device("cpu")


class IdleExpertOffload:
    """Keeps only the transformer that runs on ``device``: a forward pre-hook on each moves the
    others to host memory and it in, when it is not there already. ``moves`` counts the
    transformers moved in (``/v1/stats``: ``offload_moves``)."""

    def __init__(self, transformers: dict[str, torch.nn.Module], device: torch.device):
        self.transformers = transformers
        self.device = torch.device(device)
        self.resident: str | None = None
        self.moves = 0
        names = list(transformers)
        for name in names[1:]:  # all but the first start in host memory
            transformers[name].to(HOST)
        self.resident = names[0]
        self._handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in transformers.items()]

    def _hook(self, name: str):
        def bring_in(_module, _args):
            self.use(name)
        return bring_in

    def use(self, name: str) -> None:
        """Make ``name`` the transformer on the device (no-op when it is already)."""
        if self.resident == name:
            return
        for other, module in self.transformers.items():
            if other != name:
                module.to(HOST)
        self.transformers[name].to(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the expert that left gives its memory back to the allocator
        self.resident = name
        self.moves += 1


def apply_offload(mode: str, transformers: dict[str, torch.nn.Module], device) -> IdleExpertOffload | None:
    """Apply ``model.offload=mode`` to the family's ``transformers`` (loaded on ``device``).
    Returns the :class:`IdleExpertOffload` for ``idle_expert`` (its counters), else None.
    Raises ``ValueError`` for an unknown mode."""
    if mode not in OFFLOAD_MODES:
        raise ValueError(offload_problems(mode, boundary_experts=False, torch_compile=False)[0])
    if mode == OffloadMode.IDLE_EXPERT:
        return IdleExpertOffload(transformers, device)
    if mode == OffloadMode.GROUP:
        from diffusers.hooks import apply_group_offloading

        device = torch.device(device)
        for module in transformers.values():
            apply_group_offloading(module, onload_device=device, offload_device=HOST, offload_type="block_level",
                                   num_blocks_per_group=1, use_stream=device.type == "cuda")
    return None
