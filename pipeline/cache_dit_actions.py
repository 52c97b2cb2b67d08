"""Performing Cache-DiT actions on one transformer with the real cache-dit package.

Which action happens is decided by ``pipeline.state.plan_transition``; this module only does it:
``mount`` (``cache_dit.enable_cache``), ``refresh`` (``refresh_context``: resize the context for
a batch's step count), ``unmount`` (``disable_cache``). DBCache and its knobs are cache-dit's
(Dual Block Cache, github.com/vipshop/cache-dit); the step-computation mask presets are
cache-dit's ``steps_mask`` policies (tuned on 28 steps). Transformer classes cache-dit has no
adapter for get one from :data:`BLOCK_REGISTRY`.
"""

from __future__ import annotations

import torch

from compat import cache_dit as compat
from pipeline.cache_dit_params import CacheDiTParams
from pipeline.state import CacheKey


def build_cache_config(params: CacheDiTParams, num_inference_steps: int, separate_cfg: bool,
                       run_steps: list[int] | None = None):
    """cache-dit configs for one transformer in one batch: ``(DBCacheConfig, TaylorSeerCalibratorConfig | None)``.

    ``params``: the transformer's override (``secondary`` ignored: see
    ``CacheDiTParams.for_transformer``). ``run_steps``: the indices (of ``num_inference_steps``)
    at which this transformer runs, e.g. one expert's side of a boundary; None: all. The
    step-computation mask (an SCM preset or explicit bins) is made for the whole schedule, then
    sliced to ``run_steps`` with the slice's first step computed (an expert's context starts
    empty). Raises ``ValueError`` if explicit SCM bins do not cover ``num_inference_steps``.
    """
    import cache_dit
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    run_steps = list(range(num_inference_steps)) if run_steps is None else list(run_steps)
    config = {"num_inference_steps": len(run_steps), "enable_separate_cfg": separate_cfg}
    knobs = params.set_knobs()
    for name in ("Fn_compute_blocks", "Bn_compute_blocks", "max_warmup_steps", "residual_diff_threshold",
                 "max_continuous_cached_steps"):
        if name in knobs:
            config[name] = knobs[name]
    mask = None
    if params.scm_compute_bins is not None:
        compute, cache = list(params.scm_compute_bins), list(params.scm_cache_bins)
        if sum(compute) + sum(cache) < num_inference_steps:
            raise ValueError(f"cache_dit_params: scm_compute_bins + scm_cache_bins cover {sum(compute) + sum(cache)}"
                             f" steps, fewer than num_inference_steps={num_inference_steps}")
        mask = cache_dit.steps_mask(compute_bins=compute, cache_bins=cache, total_steps=num_inference_steps)
    elif params.has_mask:
        mask = cache_dit.steps_mask(total_steps=num_inference_steps, mask_policy=params.scm_preset)
    if mask is not None:
        part = [mask[i] for i in run_steps]
        config["steps_computation_mask"] = [1, *part[1:]] if part else part
        config["steps_computation_policy"] = params.scm_policy or "dynamic"
    calibrator = None
    if params.enable_taylorseer:
        calibrator = TaylorSeerCalibratorConfig(taylorseer_order=params.taylorseer_order or 1)
    return DBCacheConfig(**config), calibrator


def preset_step_counts(max_steps: int) -> dict[str, tuple[int, ...]]:
    """Per SCM preset, the step counts in ``1..max_steps`` for which cache-dit's own mask
    builder (``steps_mask``) and config accept the preset's mask: the table requests are
    validated against before queueing (cache-dit's presets need 4, 6 or >= 8 steps today)."""
    import cache_dit
    from cache_dit import DBCacheConfig

    table = {}
    for preset in ("slow", "medium", "fast", "ultra"):
        valid = []
        for steps in range(1, max_steps + 1):
            try:
                mask = cache_dit.steps_mask(total_steps=steps, mask_policy=preset)
                DBCacheConfig(num_inference_steps=steps, steps_computation_mask=mask)
            except Exception:  # cache-dit asserts on counts its masks cannot serve
                continue
            valid.append(steps)
        table[preset] = tuple(valid)
    return table


# Transformer classes cache-dit has no adapter for: blocks attributes and forward patterns.
# Keyed by class name; cache-dit's own registry wins for classes it knows.
BLOCK_REGISTRY: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def register_blocks(class_name: str, blocks: tuple[str, ...], patterns: tuple[str, ...]) -> None:
    """Teach Cache-DiT a transformer cache-dit does not know, e.g.
    ``register_blocks("MyDiT", ("blocks",), ("Pattern_1",))`` (cache-dit ``ForwardPattern`` names).
    Raises ``ValueError`` unless ``blocks`` and ``patterns`` are the same length."""
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
                     f"pipeline.cache_dit_actions.register_blocks")


class CacheDiTExecutor:
    """Mounts, refreshes and unmounts cache-dit on one transformer, and counts what it did.

    Mounting rewrites ``transformer.forward``: sequence-parallel split hooks are taken off and
    put back on top around it (``parallel.sharding.sequence_split_suspended``). Every failure
    leaves the transformer unmounted (hooks removed) before the error propagates.
    """

    def __init__(self, transformer: torch.nn.Module):
        from parallel.sharding import sequence_split_suspended

        self._suspend_split = sequence_split_suspended
        self.transformer = transformer
        self.counters = {"mounts": 0, "refreshes": 0, "unmounts": 0, "remounts": 0, "mount_failures": 0}

    def mount(self, key: CacheKey, num_inference_steps: int, run_steps: list[int], *, remount: bool = False) -> None:
        """Mount cache-dit with ``key`` sized for ``run_steps`` of ``num_inference_steps``
        (``remount``: unmount the current context first)."""
        import cache_dit

        with self._suspend_split(self.transformer):
            try:
                if remount:
                    compat.disable_cache(self.transformer)
                config, calibrator = build_cache_config(key.params, num_inference_steps, key.separate_cfg,
                                                        run_steps)
                cache_dit.enable_cache(_cache_target(self.transformer, key.separate_cfg),
                                       cache_config=config, calibrator_config=calibrator)
            except Exception:
                self.counters["mount_failures"] += 1
                self._remove_hooks()
                raise
        self.counters["remounts" if remount else "mounts"] += 1

    def refresh(self, key: CacheKey, num_inference_steps: int, run_steps: list[int]) -> None:
        """Resize the mounted context for this batch (same key, maybe another step count)."""
        import cache_dit

        try:
            config, calibrator = build_cache_config(key.params, num_inference_steps, key.separate_cfg, run_steps)
            kwargs = {"cache_config": config}
            if calibrator is not None:
                kwargs["calibrator_config"] = calibrator
            cache_dit.refresh_context(self.transformer, **kwargs)
        except Exception:
            self.reset()
            raise
        self.counters["refreshes"] += 1

    def unmount(self) -> None:
        with self._suspend_split(self.transformer):
            try:
                compat.disable_cache(self.transformer)
            except Exception:
                self.counters["mount_failures"] += 1
                self._remove_hooks()
                raise
        self.counters["unmounts"] += 1

    def reset(self) -> None:
        """Remove any hooks (after a failure), leaving the exact forward path."""
        if compat.is_mounted(self.transformer):
            with self._suspend_split(self.transformer):
                self._remove_hooks()

    def _remove_hooks(self) -> None:
        try:
            compat.disable_cache(self.transformer)
        except Exception:  # nothing mounted after all
            pass

    def cached_steps(self, before: int | None = None) -> int:
        """Steps of the last batch served from cache (conditional branch), 0 when unmounted;
        ``before``: only those of the context's step indices below it."""
        if not compat.is_mounted(self.transformer):
            return 0
        import cache_dit

        stats = cache_dit.summary(self.transformer, logging=False) or []
        return max((len([i for i in s.cached_steps or [] if before is None or i < before]) for s in stats), default=0)

    def skip_guide_call(self, key: CacheKey | None) -> None:
        """CFG gating skipped the guiding forward of a step. A separate-CFG context tells the
        two calls of a step apart by parity, so advance it one call."""
        if key is not None and key.separate_cfg:
            compat.advance_one_call(self.transformer)
