"""The one registry of request-switchable attention kernels (torch-free).

Request validation (``pipeline.contract``), the per-layer kernel switch (``pipeline.attention``)
and sequence-parallel attention (``parallel.attention``) all read :data:`KERNELS`; a new kernel
is one :class:`KernelSpec` entry. It lives in ``parallel/`` because that is the lowest layer:
``pipeline`` may import ``parallel``, not the reverse. Dtypes are named as strings
(``"bfloat16"``) so the processes that only route (Ingress, Router) never import torch.

Names: ``diffusers_backend`` is a value of diffusers' ``AttentionBackendName``; ``yunchang``
is the name of yunchang's ``AttnType`` that runs the kernel over a sharded sequence on CUDA.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSpec:
    """One attention kernel a request may pick with ``attention_backend_override``.

    ``package``: the module it imports (None: part of torch). ``cuda_only``: needs a CUDA
    device. ``dtypes``: the dtypes it runs (None: any). ``exact``: computes exact softmax
    attention (False: quantised, e.g. SageAttention). ``exact_lse``: its yunchang kernel
    returns the exact float32 log-sum-exp ring attention merges partial results by (False:
    none, zeros, or a padded one), so it may serve ``ring_degree > 1``. ``hub_only``: diffusers
    offers it only as a kernel downloaded at run time, which ditserve never does.
    """

    name: str
    diffusers_backend: str
    yunchang: str | None
    package: str | None = None
    cuda_only: bool = False
    dtypes: tuple[str, ...] | None = None
    exact: bool = True
    exact_lse: bool = False
    hub_only: bool = False


KERNELS: dict[str, KernelSpec] = {spec.name: spec for spec in (
    KernelSpec("fa", "flash", "FA", package="flash_attn", cuda_only=True, dtypes=("float16", "bfloat16"),
               exact_lse=True),
    KernelSpec("torch_sdpa", "native", "TORCH_EFFICIENT"),
    KernelSpec("sage_attn", "sage", "SAGE_AUTO", package="sageattention", cuda_only=True,
               dtypes=("float16", "bfloat16"), exact=False),
    # SageAttention 3 (Blackwell FP4): diffusers ships it only as "sage_blackwell_hub", a hub
    # kernel downloaded at run time; ditserve never downloads, so it is always refused.
    KernelSpec("sage_attn_3", "sage_blackwell_hub", None, package="sageattn3", cuda_only=True,
               dtypes=("float16", "bfloat16"), exact=False, hub_only=True),
    # PyTorch's exact math SDPA: the CPU-capable kernel.
    KernelSpec("torch_math", "_native_math", "TORCH_MATH"),
)}


def kernel_names() -> tuple[str, ...]:
    """The values ``attention_backend_override`` accepts, in registry order."""
    return tuple(KERNELS)


def kernel_for_backend(diffusers_backend: str | None) -> str | None:
    """The request name of a diffusers ``AttentionBackendName`` value (None: the default)."""
    return next((s.name for s in KERNELS.values() if s.diffusers_backend == diffusers_backend), None)


def kernel_rejections(name: str, *, device_type: str, dtype: str, torch_compile: bool, num_layers: int,
                      ring_degree: int = 1) -> list[str]:
    """Every reason kernel ``name`` cannot run on a replica of this kind (empty: it can).

    ``device_type``: ``"cuda"`` or ``"cpu"``; ``dtype``: the transformer's dtype name
    (``"bfloat16"``); ``num_layers``: switchable attention layers. Checks here need no torch:
    the registry's facts and whether the package is importable. ``pipeline.attention`` adds
    diffusers' own requirement check of the backend.
    """
    spec = KERNELS.get(name)
    if spec is None:
        return [f"unknown attention backend {name!r}; allowed: {', '.join(KERNELS)}"]
    reasons = []
    if torch_compile:
        reasons.append("torch.compile is on for this deployment (switching kernels would recompile)")
    if num_layers == 0:
        reasons.append("the model has no switchable attention layers")
    if ring_degree > 1:
        reasons.append(f"the replica runs ring attention (ring_degree={ring_degree}); the kernel is fixed")
    if spec.hub_only:
        reasons.append(f"{name} has no local diffusers backend (only the run-time hub download "
                       f"{spec.diffusers_backend!r}, which ditserve does not allow)")
    elif spec.package is not None and importlib.util.find_spec(spec.package) is None:
        reasons.append(f"package {spec.package!r} is not installed (pip install 'ditserve[gpu]')")
    if spec.cuda_only and device_type != "cuda":
        reasons.append(f"{name} needs a CUDA device; this replica runs on {device_type}")
    if spec.dtypes is not None and dtype not in spec.dtypes:
        reasons.append(f"{name} supports {', '.join(spec.dtypes)}, not {dtype}")
    return reasons
