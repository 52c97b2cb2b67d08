"""Request-switchable attention kernels: validation with every reason, and a two-phase switch.

Names are ditserve's request values; each maps to a diffusers attention-dispatcher backend
(``diffusers.models.attention_dispatch.AttentionBackendName``) set per attention processor
(``processor._attention_backend``), never through the process-global active backend.
"""

from __future__ import annotations

import importlib.util

import torch

from pipeline.accel import ATTENTION_BACKENDS

# request name -> (diffusers backend, package it imports or None, needs CUDA, dtypes it supports or None)
KERNELS: dict[str, tuple[str, str | None, bool, tuple[torch.dtype, ...] | None]] = {
    "fa": ("flash", "flash_attn", True, (torch.float16, torch.bfloat16)),
    "torch_sdpa": ("native", None, False, None),
    "sage_attn": ("sage", "sageattention", True, (torch.float16, torch.bfloat16)),
    # SageAttention 3 (Blackwell FP4): diffusers ships it only as a hub kernel downloaded at run
    # time ("sage_blackwell_hub"); ditserve never downloads, so it is refused with that reason.
    "sage_attn_3": ("sage_blackwell_hub", "sageattn3", True, (torch.float16, torch.bfloat16)),
    "torch_math": ("_native_math", None, False, None),  # exact; the CPU-capable kernel
}
assert set(KERNELS) == set(ATTENTION_BACKENDS)


def switchable_layers(module: torch.nn.Module) -> list:
    """Attention processors that take a per-layer dispatcher backend."""
    return [m.processor for m in module.modules()
            if getattr(m, "processor", None) is not None and hasattr(m.processor, "_attention_backend")]


def kernel_rejections(name: str, *, device: torch.device, dtype: torch.dtype, torch_compile: bool,
                      num_layers: int, ring_degree: int = 1) -> list[str]:
    """Every reason ``attention_backend_override=name`` cannot run on this replica (empty: it can)."""
    if name not in KERNELS:
        return [f"unknown attention backend {name!r}; allowed: {', '.join(KERNELS)}"]
    backend, package, needs_cuda, dtypes = KERNELS[name]
    reasons = []
    if torch_compile:
        reasons.append("torch.compile is on for this deployment (switching kernels would recompile)")
    if num_layers == 0:
        reasons.append("the model has no switchable attention layers")
    if ring_degree > 1:
        reasons.append(f"the replica runs ring attention (ring_degree={ring_degree}); the kernel is fixed")
    if name == "sage_attn_3":
        reasons.append("SageAttention 3 has no local diffusers backend (only the run-time hub download "
                       "'sage_blackwell_hub', which ditserve does not allow)")
    elif package is not None and importlib.util.find_spec(package) is None:
        reasons.append(f"package {package!r} is not installed (pip install 'ditserve[gpu]')")
    if needs_cuda and device.type != "cuda":
        reasons.append(f"{name} needs a CUDA device; this replica runs on {device.type}")
    if dtypes is not None and dtype not in dtypes:
        reasons.append(f"{name} supports {', '.join(str(d).removeprefix('torch.') for d in dtypes)}, "
                       f"not {str(dtype).removeprefix('torch.')}")
    return reasons


class AttentionSwitch:
    """Two-phase kernel switch over every switchable layer of one or more transformers.

    ``prepare`` resolves and checks the kernel and may raise, changing nothing; ``apply``
    flips every layer and cannot fail. ``None`` returns the layers to the server default.
    """

    def __init__(self, modules: list[torch.nn.Module], default: str | None = None):
        self.layers = [p for m in modules for p in switchable_layers(m)]
        self.default = default
        self.active: str | None = None  # None: diffusers' default dispatch (torch SDPA)
        self.switches = 0
        if default is not None:
            self.apply(self.prepare(default))

    def prepare(self, name: str | None):
        """Resolve ``name`` (or the default) to a diffusers backend; raises ``ValueError`` when
        the kernel is unusable here. Mutates nothing."""
        from diffusers.models.attention_dispatch import (AttentionBackendName, _AttentionBackendRegistry,
                                                         _check_attention_backend_requirements)

        target = name if name is not None else self.default
        if target is None:
            return None, None
        backend = AttentionBackendName(KERNELS[target][0])
        try:
            _check_attention_backend_requirements(backend)
        except RuntimeError as exc:
            raise ValueError(f"attention backend {target!r} is unusable: {exc}") from None
        if backend not in _AttentionBackendRegistry._backends:
            raise ValueError(f"attention backend {target!r}: diffusers has no kernel registered for {backend.value}")
        return target, backend

    def apply(self, prepared) -> bool:
        """Flip every layer to the prepared kernel; returns whether anything changed."""
        target, backend = prepared
        if target == self.active:
            return False
        for processor in self.layers:
            processor._attention_backend = backend
        self.active = target
        self.switches += 1
        return True
