"""The per-layer attention-kernel switch: two phases over every switchable layer.

Kernels are ``parallel.kernels.KERNELS`` entries; each maps to a diffusers attention-dispatcher
backend set per attention processor, never through the process-global active backend.
``prepare`` resolves and checks a kernel and may raise, changing nothing; ``apply`` flips every
layer and cannot fail. Which kernel a batch wants is decided by ``pipeline.state``.
"""

from __future__ import annotations

import torch

from compat import diffusers as compat
from parallel.kernels import KERNELS, kernel_rejections


def switchable_layers(module: torch.nn.Module) -> list:
    """Attention processors of ``module`` that take a per-layer dispatcher backend."""
    return [m.processor for m in module.modules()
            if getattr(m, "processor", None) is not None and compat.has_backend_slot(m.processor)]


def replica_kernel_rejections(name: str, *, device: torch.device, dtype: torch.dtype, torch_compile: bool,
                              num_layers: int, ring_degree: int = 1) -> list[str]:
    """Every reason kernel ``name`` cannot run on this replica: the registry's checks
    (``parallel.kernels.kernel_rejections``) plus diffusers' own requirement check of its backend."""
    reasons = kernel_rejections(name, device_type=device.type, dtype=str(dtype).removeprefix("torch."),
                                torch_compile=torch_compile, num_layers=num_layers, ring_degree=ring_degree)
    spec = KERNELS.get(name)
    if spec is not None and not spec.hub_only and not any("not installed" in r for r in reasons):
        problem = compat.backend_problem(spec.diffusers_backend)
        if problem:
            reasons.append(f"diffusers cannot use it: {problem}")
    return reasons


class AttentionSwitch:
    """Two-phase kernel switch over every switchable layer of one or more transformers."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.layers = [p for m in modules for p in switchable_layers(m)]
        self.switches = 0

    @staticmethod
    def prepare(name: str | None):
        """Resolve kernel ``name`` (None: diffusers' default) to a diffusers backend. Raises
        ``ValueError`` when the kernel is unusable here. Mutates nothing."""
        if name is None:
            return None
        spec = KERNELS[name]
        problem = compat.backend_problem(spec.diffusers_backend)
        if problem:
            raise ValueError(f"attention backend {name!r} is unusable: {problem}")
        return compat.attention_backend(spec.diffusers_backend)

    def apply(self, backend) -> None:
        """Flip every layer to a prepared backend (None: diffusers' default). Cannot fail."""
        for processor in self.layers:
            compat.set_processor_backend(processor, backend)
        self.switches += 1
