"""Cache-DiT acceleration state of one rank: a transition table and the executor that runs it.

The transition is a pure function of (active key, wanted key); the executor performs it with
the cache-dit package itself (``enable_cache`` with ``DBCacheConfig``,
``TaylorSeerCalibratorConfig``, ``steps_mask``, ``refresh_context``, ``disable_cache``).
DBCache and its knobs are cache-dit's (Dual Block Cache, github.com/vipshop/cache-dit); the
step-computation mask presets are cache-dit's ``steps_mask`` policies (tuned on 28 steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NONE, REFRESH, MOUNT, UNMOUNT, REMOUNT = "none", "refresh", "mount", "unmount", "remount"


@dataclass(frozen=True)
class CacheKey:
    """What a mounted Cache-DiT context depends on, apart from the step count.

    ``overrides``: the frozen ``cache_dit_params`` key (``()`` = cache-dit's defaults).
    ``separate_cfg``: the batch really runs a separate unconditional forward per step.
    """

    overrides: tuple
    separate_cfg: bool


def cache_transition(active: CacheKey | None, wanted: CacheKey | None) -> str:
    """The table: (active, wanted) → none | refresh | mount | unmount | remount."""
    if wanted is None:
        return NONE if active is None else UNMOUNT
    if active is None:
        return MOUNT
    return REFRESH if active == wanted else REMOUNT


def build_cache_config(overrides: tuple, num_inference_steps: int, separate_cfg: bool,
                       run_steps: list[int] | None = None):
    """cache-dit configs for one transformer in one batch: ``(DBCacheConfig, TaylorSeerCalibratorConfig | None)``.

    ``overrides``: the frozen knobs (``secondary`` ignored: see :func:`transformer_overrides`).
    ``run_steps``: the indices (of ``num_inference_steps``) at which this transformer runs,
    e.g. one expert's side of a boundary; None: all. The step-computation mask (an SCM
    preset or explicit bins) is made for the whole schedule, then sliced to ``run_steps``
    with the slice's first step computed (an expert's context starts empty).
    Raises ``ValueError`` if explicit SCM bins do not cover ``num_inference_steps``.
    """
    import cache_dit
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    knobs = {k: v for k, v in overrides if k != "secondary"}
    run_steps = list(range(num_inference_steps)) if run_steps is None else list(run_steps)
    config = {"num_inference_steps": len(run_steps), "enable_separate_cfg": separate_cfg}
    for name in ("Fn_compute_blocks", "Bn_compute_blocks", "max_warmup_steps", "residual_diff_threshold",
                 "max_continuous_cached_steps"):
        if name in knobs:
            config[name] = knobs[name]
    preset = knobs.get("scm_preset")
    mask = None
    if "scm_compute_bins" in knobs:
        compute, cache = list(knobs["scm_compute_bins"]), list(knobs["scm_cache_bins"])
        if sum(compute) + sum(cache) < num_inference_steps:
            raise ValueError(f"cache_dit_params: scm_compute_bins + scm_cache_bins cover {sum(compute) + sum(cache)}"
                             f" steps, fewer than num_inference_steps={num_inference_steps}")
        mask = cache_dit.steps_mask(compute_bins=compute, cache_bins=cache, total_steps=num_inference_steps)
    elif preset not in (None, "none"):
        mask = cache_dit.steps_mask(total_steps=num_inference_steps, mask_policy=preset)
    if mask is not None:
        part = [mask[i] for i in run_steps]
        config["steps_computation_mask"] = [1, *part[1:]] if part else part
        config["steps_computation_policy"] = knobs.get("scm_policy", "dynamic")
    calibrator = None
    if knobs.get("enable_taylorseer"):
        calibrator = TaylorSeerCalibratorConfig(taylorseer_order=knobs.get("taylorseer_order", 1))
    return DBCacheConfig(**config), calibrator


def transformer_overrides(overrides: tuple, name: str) -> tuple:
    """The knobs of transformer ``name``: the request's for ``transformer``; for
    ``transformer_2`` the request's ``secondary`` knobs over the primary's (inheritance:
    a knob the secondary does not set is the primary's, SCM settings included)."""
    knobs = {k: v for k, v in overrides if k != "secondary"}
    if name != "transformer":
        knobs.update(dict(dict(overrides).get("secondary", ())))
    return tuple(sorted(knobs.items()))


# Transformer classes cache-dit has no adapter for: blocks attributes and forward patterns.
# Keyed by class name; cache-dit's own registry wins for classes it knows.
BLOCK_REGISTRY: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def register_blocks(class_name: str, blocks: tuple[str, ...], patterns: tuple[str, ...]) -> None:
    """Teach the executor a transformer cache-dit does not know, e.g.
    ``register_blocks("MyDiT", ("blocks",), ("Pattern_1",))`` (cache-dit ``ForwardPattern`` names)."""
    if len(blocks) != len(patterns):
        raise ValueError("one ForwardPattern per blocks attribute")
    BLOCK_REGISTRY[class_name] = (tuple(blocks), tuple(patterns))


def _cache_target(transformer: torch.nn.Module, separate_cfg: bool):
    """The transformer itself when cache-dit knows its class, else a BlockAdapter from the registry."""
    from cache_dit import BlockAdapter, BlockAdapterRegister, ForwardPattern

    name = type(transformer).__name__
    if name in BLOCK_REGISTRY:
        blocks, patterns = BLOCK_REGISTRY[name]
        return BlockAdapter(transformer=transformer, blocks=[getattr(transformer, b) for b in blocks],
                            forward_pattern=[getattr(ForwardPattern, p) for p in patterns],
                            has_separate_cfg=separate_cfg, check_forward_pattern=True)
    if BlockAdapterRegister.is_supported(transformer):
        return transformer
    raise ValueError(f"cache-dit has no adapter for {name}; register its blocks with "
                     f"pipeline.cache_dit_state.register_blocks")


class CacheDiTExecutor:
    """Performs transitions on one transformer and remembers the active key.

    Every failure leaves the transformer unmounted (hooks removed) and ``active`` None.
    """

    def __init__(self, transformer: torch.nn.Module):
        from parallel.sharding import sequence_split_suspended

        self._suspend_split = sequence_split_suspended  # cache-dit rewrites forward: keep SP hooks outermost
        self.transformer = transformer
        self.active: CacheKey | None = None
        self.counters = {"mounts": 0, "refreshes": 0, "unmounts": 0, "remounts": 0, "mount_failures": 0}

    def apply(self, wanted: CacheKey | None, num_inference_steps: int, run_steps: list[int] | None = None) -> str:
        """Move to ``wanted`` for a batch of ``num_inference_steps`` of which this transformer
        runs ``run_steps`` (None: all); return the transition.

        Raises ``ValueError`` / cache-dit's errors on a failed mount or refresh, after
        unmounting.
        """
        transition = cache_transition(self.active, wanted)
        if transition in (MOUNT, UNMOUNT, REMOUNT):
            with self._suspend_split(self.transformer):
                return self._apply(transition, wanted, num_inference_steps, run_steps)
        return self._apply(transition, wanted, num_inference_steps, run_steps)

    def _apply(self, transition: str, wanted: CacheKey | None, num_inference_steps: int, run_steps) -> str:
        import cache_dit

        try:
            if transition in (UNMOUNT, REMOUNT):
                self._unmount()
            if transition in (MOUNT, REMOUNT):
                config, calibrator = build_cache_config(wanted.overrides, num_inference_steps, wanted.separate_cfg,
                                                        run_steps)
                self.active = wanted  # before enable_cache: a failure below must be undone
                cache_dit.enable_cache(_cache_target(self.transformer, wanted.separate_cfg),
                                       cache_config=config, calibrator_config=calibrator)
            elif transition == REFRESH:
                config, calibrator = build_cache_config(wanted.overrides, num_inference_steps, wanted.separate_cfg,
                                                        run_steps)
                kwargs = {"cache_config": config}
                if calibrator is not None:
                    kwargs["calibrator_config"] = calibrator
                cache_dit.refresh_context(self.transformer, **kwargs)
        except Exception:
            if transition in (MOUNT, REMOUNT):
                self.counters["mount_failures"] += 1
            if transition == REFRESH:
                self.reset()
            else:  # already inside sequence_split_suspended
                self._remove_hooks()
            raise
        key = {MOUNT: "mounts", REFRESH: "refreshes", UNMOUNT: "unmounts", REMOUNT: "remounts"}.get(transition)
        if key:
            self.counters[key] += 1
        return transition

    def _unmount(self) -> None:
        import cache_dit

        cache_dit.disable_cache(self.transformer)
        self.active = None

    def reset(self) -> None:
        """Remove any hooks (after a failure), leaving the exact forward path."""
        if self.active is not None or hasattr(self.transformer, "_context_manager"):
            with self._suspend_split(self.transformer):
                self._remove_hooks()
        self.active = None

    def _remove_hooks(self) -> None:
        try:
            self._unmount()
        except Exception:  # nothing mounted after all
            pass
        self.active = None

    def cached_steps(self) -> int:
        """Steps the last batch served from cache (conditional branch), 0 when unmounted."""
        if self.active is None:
            return 0
        import cache_dit

        stats = cache_dit.summary(self.transformer, logging=False) or []
        return max((len(s.cached_steps or []) for s in stats), default=0)

    def skip_uncond_slot(self) -> None:
        """CFG gating skipped the unconditional forward of a step. cache-dit's separate-CFG
        contexts tell branches apart by call parity, so advance each context one call."""
        manager = getattr(self.transformer, "_context_manager", None)
        if self.active is None or not self.active.separate_cfg or manager is None:
            return
        for context in manager._cached_context_manager.values():
            context.mark_step_begin()


class CacheDiTState:
    """The Cache-DiT state of every transformer of one rank: one executor (own context,
    own key) per transformer, moved together at a batch boundary.

    For dual-transformer models the secondary's knobs inherit from the primary's
    (:func:`transformer_overrides`) and each transformer's context is sized and masked for
    the steps it runs in the batch; a transformer that runs no step keeps its state.
    """

    def __init__(self, transformers: dict[str, torch.nn.Module]):
        self.executors = {name: CacheDiTExecutor(module) for name, module in transformers.items()}
        self.last_transitions: dict[str, str] = {}

    @property
    def primary(self) -> CacheDiTExecutor:
        return self.executors["transformer"]

    @property
    def active(self) -> CacheKey | None:
        """The primary transformer's key (what the request asked for)."""
        return self.primary.active

    @property
    def counters(self) -> dict:
        total: dict = {}
        for executor in self.executors.values():
            for key, value in executor.counters.items():
                total[key] = total.get(key, 0) + value
        return total

    def apply(self, overrides: tuple | None, num_inference_steps: int, run_steps: dict[str, list[int]],
              separate_cfg: dict[str, bool]) -> str:
        """Move every transformer that runs in this batch to its key (``overrides`` None:
        Cache-DiT off). Returns the primary's transition (or the first that is not
        ``none``). On any failure every transformer is left unmounted and the error raised.
        """
        transitions = {}
        try:
            for name, executor in self.executors.items():
                steps = run_steps.get(name)
                if not steps:
                    continue
                wanted = None if overrides is None else CacheKey(transformer_overrides(overrides, name),
                                                                 separate_cfg.get(name, False))
                transitions[name] = executor.apply(wanted, num_inference_steps, steps)
        except Exception:
            self.reset()
            raise
        self.last_transitions = transitions
        main = transitions.get("transformer", NONE)
        return main if main != NONE else next((t for t in transitions.values() if t != NONE), NONE)

    def reset(self) -> None:
        for executor in self.executors.values():
            executor.reset()

    def cached_steps(self) -> dict[str, int]:
        """Per transformer: steps of the last batch served from cache (0 when unmounted)."""
        return {name: executor.cached_steps() for name, executor in self.executors.items()}

    def skip_uncond_slot(self, name: str = "transformer") -> None:
        self.executors[name].skip_uncond_slot()
