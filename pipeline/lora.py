"""LoRA adapters on one rank: checked at registration, loaded into an LRU, activated per batch.

Everything goes through diffusers / PEFT, never our own weight patching:

* **eager** (no torch.compile): each adapter is loaded with the pipeline's own
  ``load_lora_weights`` (diffusers' converters read diffusers/PEFT, kohya and xlabs FLUX
  files) under its registered name, kept in an LRU of ``max_loaded`` adapters (the least
  recently used one is deleted with ``delete_adapters``), and a batch's set is activated with
  ``set_adapters(names, scales)``; the base model is ``disable_lora``.
* **hot-swap** (torch.compile on): diffusers' LoRA hot-swap (``load_lora_adapter(...,
  hotswap=True)``, after ``enable_lora_hotswap``-style preparation: PEFT's
  ``prepare_model_for_compiled_hotswap`` pads every slot to ``max_rank`` and turns the scalings
  into tensors). The transformer carries ``slots`` adapter slots, all always active, created
  before compilation over the union of the registered adapters' target modules; a batch's
  adapters are swapped into the slots (scale folded into ``lora_B``), unused slots hold zeros.
  The compiled graph never changes, so switching adapters never recompiles. The LRU then keeps
  the adapters' state dicts in host memory.

Counters (``loads``, ``evictions``, ``hits``) feed ``/v1/stats`` and Prometheus.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from pipeline.contract.lora import LoraSpec

logger = logging.getLogger("ditserve.lora")
SLOT_PREFIX = "ditserve_slot"


class AdapterLoadError(RuntimeError):
    """An adapter's file could not be loaded (missing, corrupt, not a LoRA): the batch that
    wanted it fails, naming ``adapter``; the rank unloads what it had of it and keeps serving."""

    def __init__(self, adapter: str, cause: BaseException, public: str | None = None):
        super().__init__(f"LoRA adapter {adapter!r} could not be loaded ({type(cause).__name__}: {cause})")
        self.adapter = adapter
        self.cause = cause
        self.public = public or type(cause).__name__  # what a client may read (no file paths)

    def __reduce__(self):  # pickled with its fields (Exception's default re-calls __init__ with the message)
        return type(self), (self.adapter, self.cause, self.public)


def lora_state_dict(pipe, path: str) -> dict[str, torch.Tensor]:
    """The transformer part of the LoRA file(s) at ``path``, converted to diffusers/PEFT keys by
    the pipeline's own ``lora_state_dict`` (kohya / xlabs / PEFT formats); keys start with
    ``transformer.``. Raises ``ValueError`` when the file has weights for another component
    (text encoders: only transformer adapters are served) or no LoRA weights at all, and
    ``FileNotFoundError`` when ``path`` does not exist."""
    return lora_file(pipe, path)[0]


def _source(path: str) -> tuple[str, dict]:
    """``load_lora_weights``'s source and keyword arguments for a local file or directory;
    raises ``FileNotFoundError`` when ``path`` does not exist (never a hub lookup)."""
    local = Path(path)
    if not path or not local.exists():
        raise FileNotFoundError(f"{path!r} does not exist (adapters are local files)")
    kwargs = {"weight_name": local.name} if local.is_file() else {}
    return (str(local.parent) if local.is_file() else str(local)), {**kwargs, "local_files_only": True}


def lora_file(pipe, path: str) -> tuple[dict[str, torch.Tensor], dict | None, dict | None]:
    """``(state_dict, network_alphas, metadata)`` of the LoRA file(s) at ``path`` as the
    pipeline's own ``lora_state_dict`` converts them (see :func:`lora_state_dict`), with the
    alphas (kohya) and the PEFT metadata (rank, ``lora_alpha``) ``load_lora_adapter`` needs."""
    import inspect

    source, kwargs = _source(path)
    accepts = inspect.signature(type(pipe).lora_state_dict).parameters
    if "return_alphas" in accepts or "kwargs" in accepts:
        kwargs["return_alphas"] = True
    kwargs["return_lora_metadata"] = True
    out = type(pipe).lora_state_dict(source, **kwargs)
    state_dict, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    alphas = rest[0] if len(rest) == 2 else None
    metadata = rest[-1] if rest else None
    other = sorted({k.split(".")[0] for k in state_dict if not k.startswith("transformer.")})
    components = [name for name in other if name in pipe.components]
    if components:
        raise ValueError(f"has weights for {', '.join(components)}; only transformer adapters are served")
    if other:  # diffusers' own load_lora_weights skips such keys with a warning
        bare = [k for k in state_dict if not k.startswith("transformer.")]
        which = ("its keys do not" if len(bare) == len(state_dict)
                 else f"{len(bare)} of its {len(state_dict)} keys do not")
        raise ValueError(f"{which} start with 'transformer.' ({bare[0]!r}), so diffusers would not load them; save "
                         "it with the pipeline's save_lora_weights(dir, transformer_lora_layers=...), which adds the "
                         "prefix")
    if not any("lora" in k for k in state_dict):
        raise ValueError("has no LoRA weights")
    return state_dict, alphas, metadata


def adapter_problems(transformer: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Why an adapter's (converted) state dict cannot apply to ``transformer``, one problem per
    target layer: LoRA targets that are not linear layers of the model; a ``lora_A`` without its
    ``lora_B`` or the reverse; weights that are not 2-D floating-point matrices of shapes
    ``(rank, in_features)`` and ``(out_features, rank)`` with one ``rank`` >= 1; weights holding
    NaN or infinity (they turned every image of the requests naming the adapter black, answered
    200; helper-63 found the other cases failing only at the first request, a 500 each time).
    A ``lora_B.bias`` (diffusers' ``lora_bias``) and a DoRA ``lora_magnitude_vector`` are
    vectors of ``out_features``; a ``lora_A.bias`` one of ``rank``."""
    modules = dict(transformer.named_modules())
    by_target: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        name = key.removeprefix("transformer.")
        for part in (".lora_A.", ".lora_B.", ".lora_magnitude_vector"):
            if part in name:
                target, rest = name.split(part, 1)
                kind = part.strip(".") + (".bias" if rest == "bias" else "")
                by_target.setdefault(target, {})[kind] = value
                break
    problems = []
    for target, weights in by_target.items():
        problem = _target_problem(modules.get(target), weights)
        if problem:
            problems.append(f"{target}: {problem}")
    return problems[:5] + ([f"and {len(problems) - 5} more"] if len(problems) > 5 else [])


def _target_problem(module: torch.nn.Module | None, weights: dict[str, torch.Tensor]) -> str | None:
    """Why one target layer's LoRA tensors (``lora_A``, ``lora_B``, maybe ``lora_A.bias``,
    ``lora_B.bias``, ``lora_magnitude_vector``) cannot apply to ``module`` (None: they can)."""
    base = getattr(module, "base_layer", module)
    if not isinstance(base, torch.nn.Linear):
        return "not a linear layer of the model"
    if "lora_A" not in weights or "lora_B" not in weights:
        missing = " and ".join(k for k in ("lora_A", "lora_B") if k not in weights)
        return f"has {', '.join(sorted(weights))} without {missing}"
    for kind, value in weights.items():
        if not value.is_floating_point():
            return f"{kind} is {str(value.dtype).removeprefix('torch.')}, not floating point"
        if not torch.isfinite(value).all():
            return f"{kind} holds NaN or infinite values"
    down, up = weights["lora_A"], weights["lora_B"]
    if down.ndim != 2 or up.ndim != 2:
        return f"lora_A {tuple(down.shape)} and lora_B {tuple(up.shape)} must be matrices"
    if down.shape[0] == 0:
        return f"lora_A {tuple(down.shape)} has rank 0"
    if down.shape[1] != base.in_features:
        return f"lora_A {tuple(down.shape)} does not fit in_features={base.in_features}"
    if up.shape[0] != base.out_features:
        return f"lora_B {tuple(up.shape)} does not fit out_features={base.out_features}"
    if up.shape[1] != down.shape[0]:
        return f"lora_A {tuple(down.shape)} and lora_B {tuple(up.shape)} have different ranks"
    vectors = {"lora_A.bias": down.shape[0], "lora_B.bias": base.out_features,
               "lora_magnitude_vector": base.out_features}
    for kind, size in vectors.items():
        if kind in weights and tuple(weights[kind].shape) != (size,):
            return f"{kind} {tuple(weights[kind].shape)} is not a vector of {size}"
    return None


def lora_rank(state_dict: dict[str, torch.Tensor]) -> int:
    """The highest LoRA rank in a state dict (``lora_B`` columns)."""
    return max((v.shape[1] for k, v in state_dict.items() if "lora_B" in k and v.ndim == 2), default=0)


class LoraAdapters:
    """The adapters of one rank's pipeline (see the module docstring).

    ``pipe``: the family's diffusers pipeline; ``transformer``: its transformer.
    ``max_loaded``: adapters kept loaded (LRU). ``hotswap``: ``(slots, max_rank, registry)``
    for torch.compile (``registry``: name -> path of the adapters registered at start, whose
    target modules the slots cover); None for eager switching. ``compiled``: the transformer
    will be compiled: without slots (no adapter registered at start) adapters are refused,
    since loading one would change the compiled graph.
    """

    def __init__(self, pipe, transformer: torch.nn.Module, max_loaded: int = 4,
                 hotswap: tuple[int, int, dict[str, str]] | None = None, compiled: bool = False):
        self.compiled = compiled
        self.pipe = pipe
        self.transformer = transformer
        self.max_loaded = max_loaded
        self.loaded: OrderedDict[str, tuple[str, object]] = OrderedDict()  # name -> (path, state dict | None)
        self.active: tuple[LoraSpec, ...] = ()
        self.counters = {"lora_loads": 0, "lora_evictions": 0, "lora_hits": 0}
        self.slots: list[str] = []
        if hotswap is not None:
            self._create_slots(*hotswap)

    # -- registration -------------------------------------------------------------------
    def check(self, name: str, path: str) -> None:
        """Refuse an adapter that cannot apply to this model, before any request names it.
        Raises ``ValueError`` naming the adapter and every problem found."""
        try:
            state_dict = lora_state_dict(self.pipe, path)
        except Exception as exc:  # noqa: BLE001 - any reading failure is the adapter's problem
            raise ValueError(f"model.loras.{name}: cannot read {path}: {type(exc).__name__}: {exc}") from None
        problems = self._problems(state_dict)
        if problems:
            raise ValueError(f"model.loras.{name} ({path}) does not fit the model: " + "; ".join(problems))

    # -- hot-swap slots ---------------------------------------------------------------
    def _create_slots(self, slots: int, max_rank: int, registry: dict[str, str]) -> None:
        """``slots`` zero adapters of rank ``max_rank`` over the union of the registered
        adapters' target layers, all active at weight 1, then PEFT's preparation for compiled
        hot-swap (padded ranks, scalings as tensors): what diffusers' ``enable_lora_hotswap``
        arranges for one adapter, for several slots at once."""
        from peft import LoraConfig
        from peft.utils.hotswap import prepare_model_for_compiled_hotswap

        targets = set()
        for name, path in registry.items():
            state_dict = lora_state_dict(self.pipe, path)
            rank = lora_rank(state_dict)
            if rank > max_rank:
                raise ValueError(f"model.loras.{name} has rank {rank}, above model.lora_max_rank={max_rank}")
            targets |= {k.removeprefix("transformer.").split(".lora_")[0] for k in state_dict if ".lora_" in k}
        if not targets:
            return
        self.targets = sorted(targets)
        self.max_rank = max_rank
        self.slots = [f"{SLOT_PREFIX}{i}" for i in range(slots)]
        for slot in self.slots:  # zero slots: lora_B starts at zero, so the model is the base model
            self.transformer.add_adapter(LoraConfig(r=max_rank, lora_alpha=max_rank, target_modules=self.targets),
                                         adapter_name=slot)
        self.transformer.set_adapters(self.slots, [1.0] * len(self.slots))
        prepare_model_for_compiled_hotswap(self.transformer, target_rank=max_rank)  # scalings become tensors

    def _problems(self, state_dict) -> list[str]:
        """Why an adapter's state dict cannot apply here: the model's layers and shapes, and
        under torch.compile the hot-swap slots."""
        return adapter_problems(self.transformer, state_dict) + self._compile_problems(state_dict)

    def _compile_problems(self, state_dict) -> list[str]:
        """Why an adapter cannot be swapped into this compiled transformer (none when eager)."""
        if not self.compiled:
            return []
        if not self.slots:
            return ["with torch_compile, adapters must be registered at start (model.loras): the hot-swap slots "
                    "are made before the transformer is compiled"]
        rank = lora_rank(state_dict)
        outside = sorted({k.removeprefix("transformer.").split(".lora_")[0] for k in state_dict if ".lora_" in k}
                         - set(self.targets))
        problems = [f"rank {rank} is above model.lora_max_rank={self.max_rank}"] if rank > self.max_rank else []
        if outside:
            problems.append(f"with torch_compile, adapters added later may only target the layers of the adapters "
                            f"registered at start; {outside[0]} is not one of them")
        return problems

    def _swap_in(self, slot: str, spec: LoraSpec | None) -> None:
        if spec is None:
            for module in self.transformer.modules():
                if slot in getattr(module, "lora_B", {}):
                    module.lora_B[slot].weight.data.zero_()
            return
        state_dict, alphas, metadata = self.loaded[spec.name][1]
        scaled = {k: v * spec.scale if ".lora_B." in k else v for k, v in state_dict.items()}
        self.transformer.load_lora_adapter(scaled, prefix="transformer", adapter_name=slot, hotswap=True,
                                           network_alphas=alphas, metadata=metadata)

    # -- per batch ----------------------------------------------------------------------
    def _load(self, spec: LoraSpec) -> None:
        entry = self.loaded.get(spec.name)
        if entry is not None and entry[0] == spec.path:
            self.loaded.move_to_end(spec.name)
            self.counters["lora_hits"] += 1
            return
        if entry is not None:  # re-registered under the same name with another file
            self._evict(spec.name)
        try:
            if self.compiled:
                loaded = lora_file(self.pipe, spec.path)
                problems = self._problems(loaded[0])
                if problems:
                    raise ValueError("; ".join(problems))
                self.loaded[spec.name] = (spec.path, loaded)
            else:
                source, kwargs = _source(spec.path)
                self.pipe.load_lora_weights(source, adapter_name=spec.name, **kwargs)
                self.loaded[spec.name] = (spec.path, None)
        except Exception as exc:
            self._unload_partial(spec.name)
            raise AdapterLoadError(spec.name, exc) from exc
        self.counters["lora_loads"] += 1
        logger.info("LoRA adapter %s loaded (%d loaded)", spec.name, len(self.loaded))

    def _unload_partial(self, name: str) -> None:
        self.loaded.pop(name, None)
        if not self.compiled and name in getattr(self.transformer, "peft_config", {}):
            self.pipe.delete_adapters(name)

    def _evict(self, name: str) -> None:
        self.loaded.pop(name)
        if not self.compiled:
            self.pipe.delete_adapters(name)
        self.counters["lora_evictions"] += 1
        logger.info("LoRA adapter %s evicted", name)

    def activate(self, specs: tuple[LoraSpec, ...]) -> None:
        """Make ``specs`` the active adapter set (empty: the base model): load what is missing
        (evicting the least recently used adapters not in ``specs`` beyond ``max_loaded``), then
        activate. Raises ``AdapterLoadError`` naming the adapter that failed; on that or any other
        failure the rank is left on the base model, with every adapter that did load still in
        the LRU."""
        self.active = ()
        try:
            if self.compiled and len(specs) > len(self.slots):
                reason = f"{len(specs)} adapters but {len(self.slots)} hot-swap slots (limits.max_loras)"
                raise AdapterLoadError(specs[-1].name, ValueError(reason), public=reason)
            for spec in specs:
                self._load(spec)
            wanted = {s.name for s in specs}
            for name in [n for n in self.loaded if n not in wanted]:
                if len(self.loaded) <= max(self.max_loaded, len(wanted)):
                    break
                self._evict(name)
            if self.slots:
                for i, slot in enumerate(self.slots):
                    self._swap_in(slot, specs[i] if i < len(specs) else None)
            elif specs:
                self.transformer.enable_lora()
                self.transformer.set_adapters([s.name for s in specs], [s.scale for s in specs])
            else:
                self._base()
        except Exception:
            try:
                self._base()
            except Exception:  # noqa: BLE001 - the first failure is the one to report
                logger.exception("LoRA: could not return to the base model")
            raise
        self.active = specs

    def _base(self) -> None:
        if self.slots:
            for slot in self.slots:
                self._swap_in(slot, None)
        elif getattr(self.transformer, "peft_config", None):
            self.transformer.disable_lora()

    def loaded_names(self) -> list[str]:
        """Adapters held, least recently used first."""
        return list(self.loaded)
