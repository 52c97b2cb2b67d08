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

import importlib.metadata
import importlib.util
from dataclasses import dataclass

# import name -> distribution name, where they differ
DISTRIBUTIONS = {"flash_attn": "flash-attn", "sageattention": "sageattention", "sageattn3": "sageattn3"}


@dataclass(frozen=True)
class KernelSpec:
    """One attention kernel a request may pick with ``attention_backend_override``.

    ``package``: the module it imports (None: part of torch). ``cuda_only``: needs a CUDA
    device. ``dtypes``: the dtypes it runs (None: any). ``exact``: computes exact softmax
    attention (False: quantised, e.g. SageAttention). ``hub_only``: diffusers offers it only as
    a kernel downloaded at run time, which ditserve never does. ``versions``: the versions of
    ``package`` it may run with (a pip specifier; None: any). ``takes_mask``: diffusers' backend
    accepts an attention mask (flash-attn and SageAttention raise on one): models whose batches
    pad text with a mask (Qwen-Image, Z-Image) cannot run it.

    ``ring_lse``: how ring attention gets the float32 log-sum-exp it merges partial results by
    (yunchang's ``update_out_and_lse``) when this kernel runs on CUDA: ``"exact"`` — the
    yunchang kernel returns it (flash-attn); ``"padded"`` — torch's memory-efficient kernel
    returns it padded to a multiple of 32 queries, ``parallel.attention`` slices and upcasts
    it (yunchang's TORCH_EFFICIENT would pass it on padded and cast to bf16); ``"computed"``
    — ``parallel.attention`` computes it (exact math attention); None — there is none, so the
    kernel cannot run a ring layout.
    """

    name: str
    diffusers_backend: str
    yunchang: str | None
    package: str | None = None
    cuda_only: bool = False
    dtypes: tuple[str, ...] | None = None
    exact: bool = True
    ring_lse: str | None = None
    hub_only: bool = False
    versions: str | None = None
    takes_mask: bool = True


KERNELS: dict[str, KernelSpec] = {spec.name: spec for spec in (
    # flash-attn: >= 2.7 for the API yunchang calls; < 2.10 because yunchang 0.6 picks that API
    # by comparing version *strings* (flash_attn.__version__ < '2.6.3'), which '2.10' passes.
    KernelSpec("fa", "flash", "FA", package="flash_attn", cuda_only=True, dtypes=("float16", "bfloat16"),
               ring_lse="exact", versions=">=2.7,<2.10", takes_mask=False),
    KernelSpec("torch_sdpa", "native", "TORCH_EFFICIENT", ring_lse="padded"),
    # SageAttention: diffusers 0.42 needs >= 2.1.1 (_REQUIRED_SAGE_VERSION); PyPI only has 1.0.6.
    KernelSpec("sage_attn", "sage", "SAGE_AUTO", package="sageattention", cuda_only=True,
               dtypes=("float16", "bfloat16"), exact=False, versions=">=2.1.1", takes_mask=False),
    # SageAttention 3 (Blackwell FP4): diffusers ships it only as "sage_blackwell_hub", a hub
    # kernel downloaded at run time; ditserve never downloads, so it is always refused.
    KernelSpec("sage_attn_3", "sage_blackwell_hub", None, package="sageattn3", cuda_only=True,
               dtypes=("float16", "bfloat16"), exact=False, hub_only=True, takes_mask=False),
    # PyTorch's exact math SDPA: the CPU-capable kernel.
    KernelSpec("torch_math", "_native_math", "TORCH_MATH", ring_lse="computed"),
)}


def kernel_names() -> tuple[str, ...]:
    """The values ``attention_backend_override`` accepts, in registry order."""
    return tuple(KERNELS)


def kernel_for_backend(diffusers_backend: str | None) -> str | None:
    """The request name of a diffusers ``AttentionBackendName`` value (None: the default)."""
    return next((s.name for s in KERNELS.values() if s.diffusers_backend == diffusers_backend), None)


def _runs_here(spec: KernelSpec, device_type: str, dtype: str) -> list[str]:
    """Why ``spec`` cannot run on this device and dtype (registry facts and the import check)."""
    reasons = []
    if spec.hub_only:
        reasons.append(f"{spec.name} has no local diffusers backend (only the run-time hub download "
                       f"{spec.diffusers_backend!r}, which ditserve does not allow)")
    elif spec.package is not None:
        installed = installed_version(spec.package)
        if installed is None and importlib.util.find_spec(spec.package) is None:
            reasons.append(f"package {spec.package!r} is not installed (README: GPU kernels)")
        elif problem := version_problem(spec, installed):
            reasons.append(problem)
    if spec.cuda_only and device_type != "cuda":
        reasons.append(f"{spec.name} needs a CUDA device; this replica runs on {device_type}")
    if spec.dtypes is not None and dtype not in spec.dtypes:
        reasons.append(f"{spec.name} supports {', '.join(spec.dtypes)}, not {dtype}")
    return reasons


def installed_version(package: str) -> str | None:
    """The installed version of the distribution that provides import name ``package`` (None:
    not installed)."""
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(package, package))
    except importlib.metadata.PackageNotFoundError:
        return None


def version_problem(spec: KernelSpec, installed: str | None) -> str | None:
    """Why version ``installed`` of ``spec.package`` cannot serve the kernel (None: it can,
    or the kernel takes any version)."""
    if spec.versions is None or installed is None:
        return None
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = Version(installed) in SpecifierSet(spec.versions)
    except InvalidVersion:
        ok = False
    if ok:
        return None
    return (f"{DISTRIBUTIONS.get(spec.package, spec.package)} {installed} is installed; {spec.name} needs "
            f"{spec.versions} (README: GPU kernels)")


def kernel_rejections(name: str, *, device_type: str, dtype: str, torch_compile: bool, num_layers: int,
                      ring_degree: int = 1) -> list[str]:
    """Every reason a request may not switch to kernel ``name`` on a replica of this kind
    (empty: it may).

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
    return reasons + _runs_here(spec, device_type, dtype)


def default_kernel_rejections(name: str, *, device_type: str, dtype: str, ring_degree: int = 1,
                              check_installed: bool = True) -> list[str]:
    """Every reason the server's default kernel ``name`` (``acceleration.attention_backend``)
    cannot run on replicas of this kind: the same device, dtype and package rules as a
    request's override, and, under ring attention on CUDA, a way to get an exact float32
    log-sum-exp (``KernelSpec.ring_lse``). The default is set once at startup, so the
    switching rules (torch.compile, a fixed kernel under ring) do not apply.
    ``check_installed=False`` skips the import check (a config read where the GPU packages
    are not installed, e.g. the head node).
    """
    spec = KERNELS.get(name)
    if spec is None:
        return [f"unknown attention backend {name!r}; allowed: {', '.join(KERNELS)}"]
    reasons = _runs_here(spec, device_type, dtype)
    if not check_installed:
        reasons = [r for r in reasons if "is not installed" not in r]
    if ring_degree > 1 and device_type == "cuda" and spec.ring_lse is None:
        reasons.append(f"{name} gives ring attention no log-sum-exp to merge partial results by "
                       f"(ring_degree={ring_degree}); use one of "
                       f"{', '.join(n for n, s in KERNELS.items() if s.ring_lse)}")
    return reasons


def mask_problem(name: str, masked: bool) -> list[str]:
    """Why kernel ``name`` cannot serve a model whose batches carry an attention mask."""
    spec = KERNELS.get(name)
    if masked and spec is not None and not spec.takes_mask:
        return ["this model's batches carry an attention mask (text padded to the longest prompt) and the "
                "kernel takes none"]
    return []
