"""The per-layer attention-kernel switch: two phases over every switchable layer.

Kernels are ``parallel.kernels.KERNELS`` entries; each maps to a diffusers attention-dispatcher
backend set per attention processor, never through the process-global active backend.
``prepare`` resolves and checks a kernel and may raise, changing nothing; ``apply`` flips every
layer and cannot fail. Which kernel a batch wants is decided by ``pipeline.state``.
"""

from __future__ import annotations

import torch

from compat import diffusers as compat
from parallel.kernels import KERNELS, default_kernel_rejections, kernel_rejections, mask_problem


def switchable_layers(module: torch.nn.Module) -> list:
    """Attention processors of ``module`` that take a per-layer dispatcher backend."""
    return [m.processor for m in module.modules()
            if getattr(m, "processor", None) is not None and compat.has_backend_slot(m.processor)]


def replica_kernel_rejections(name: str, *, device: torch.device, dtype: torch.dtype, torch_compile: bool,
                              num_layers: int, ring_degree: int = 1, masked: bool = False) -> list[str]:
    """Every reason a request may not switch to kernel ``name`` on this replica: the
    registry's checks (``parallel.kernels.kernel_rejections``) plus diffusers' own requirement
    check of its backend (a package version below diffusers' minimum, e.g. sageattention 1.x).
    ``masked``: the model's batches carry an attention mask (``ModelFamily.masked_attention``)."""
    reasons = kernel_rejections(name, device_type=device.type, dtype=_dtype_name(dtype),
                                torch_compile=torch_compile, num_layers=num_layers, ring_degree=ring_degree)
    return reasons + mask_problem(name, masked) + _diffusers_problem(name, reasons)


def default_kernel_problems(name: str, *, device: torch.device, dtype: torch.dtype, ring_degree: int = 1,
                            masked: bool = False) -> list[str]:
    """Every reason the server's default kernel ``name`` cannot run on this replica: the
    rules of a request's override that do not concern switching
    (``parallel.kernels.default_kernel_rejections``) plus diffusers' requirement check."""
    reasons = default_kernel_rejections(name, device_type=device.type, dtype=_dtype_name(dtype),
                                        ring_degree=ring_degree)
    return reasons + mask_problem(name, masked) + _diffusers_problem(name, reasons)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _diffusers_problem(name: str, reasons: list[str]) -> list[str]:
    """diffusers' own check of kernel ``name``'s backend, unless already refused as missing."""
    spec = KERNELS.get(name)
    if spec is None or spec.hub_only or any("not installed" in r for r in reasons):
        return []
    problem = compat.backend_problem(spec.diffusers_backend)
    return [f"diffusers cannot use it: {problem}"] if problem else []


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
