"""The rank-side batch runner: owns one rank's model and acceleration state, runs batches.

It never decides what runs next. Per batch, in the design's order: plan the batch's schedule
(``pipeline.loop.plan_batch``), plan the state transition (``pipeline.state.plan_transition``:
attention kernel, Cache-DiT, torch.compile) and execute its actions, run the denoising loop,
decode and encode on rank 0. Encoding happens here so no tensor leaves the replica.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
import torch

from compat import torch as torch_compat
from pipeline.attention import AttentionSwitch, default_kernel_problems, replica_kernel_rejections
from pipeline.cache_dit_actions import CacheDiTExecutor, preset_step_counts
from pipeline.contract.limits import VIDEO_IMAGE_FORMAT
from pipeline.errors import (BatchCancelled, InternalError, InvalidRequestError, LoraLoadError, OutputEncodingError,
                             SharedFailure, about_adapter, record_dropped_rows)
from pipeline.families import detect_family, load_family
from pipeline.families.base import ModelFamily
from pipeline.lora import AdapterLoadError, LoraAdapters
from pipeline.loop import (BatchSchedule, LoopOutput, conditioning, denoise_batch, initial_latents, plan_batch,
                           steps_per_transformer)
from pipeline.media import encode_image, encode_mp4
from pipeline.modes import DualMode, InputMode, offload_problems
from pipeline.offload import apply_offload
from pipeline.sampling import SamplingParams
from pipeline.signature import BatchSignature
from pipeline.state import (Action, ActionKind, CacheKey, CacheTransition, ReplicaState, StateTransitionError,
                            after, plan_transition)
from pipeline.tiny.registry import resolve_checkpoint
from pipeline.wire import (AccelerationReport, Batch, CacheDiTReport, CfgGateReport, LoraReport, ModelFacts,
                           RequestOutput, TransformerCacheReport)
from parallel.config import paired_sharding_problem
from parallel.kernels import KERNELS

logger = logging.getLogger("ditserve.runner")


def configure_compile(device: torch.device) -> None:
    """cache-dit's recommended torch.compile settings (``cache_dit.set_compile_configs``):
    above all dynamo's recompile limit 8 → 1024, since every Cache-DiT mount, unmount and
    remount changes the hooks a compiled transformer runs through; past the limit dynamo
    would run the model uncompiled and only log it. Inductor's descent tuning only on CUDA
    (its settings are for triton kernels)."""
    import cache_dit

    cache_dit.set_compile_configs(descent_tuning=device.type == "cuda")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EVENTS_KEPT = 256  # state actions remembered for audits (the newest)


class BatchRunner:
    """Loads one checkpoint and runs signature-homogeneous batches on it, one at a time.

    ``attention_backend``: the server's default kernel (None: diffusers' default, torch SDPA).
    ``torch_compile``: compile each transformer once, after Cache-DiT is mounted when wanted;
    ``compile_backend`` is ``torch.compile``'s backend ("inductor"; "eager" for cheap tests).
    ``dual_transformer``: the execution mode of a second transformer (Wan: ``boundary`` or
    ``paired``; None: what the checkpoint declares). ``components``: ``"all"``, or
    ``"denoiser"`` on sequence-parallel ranks other than 0 (no text encoders, no VAE: rank 0
    encodes for every rank and decodes alone). ``vae_slicing``: decode one sample at a time;
    ``vae_tiling``: decode in blended spatial tiles (diffusers' ``enable_slicing`` /
    ``enable_tiling``; a ``ValueError`` when the model's VAE has no tiling). ``offload``:
    ``none | idle_expert | group`` (``pipeline.offload``).
    ``loras``: the LoRA adapters registered at start (name -> path; each is checked against the
    model now), ``max_loaded_loras`` kept in the LRU; with ``torch_compile`` the transformer gets
    ``max_loras`` hot-swap slots of rank ``lora_max_rank`` (``pipeline.lora``).
    Raises ``FileNotFoundError`` / ``ValueError`` when the checkpoint cannot be found or served,
    or a registered adapter does not fit the model.
    """

    def __init__(self, name: str, path: str | None = None, family: str | None = None,
                 dtype: str = "float32", device: str = "cpu", dual_transformer: str | None = None,
                 vae_slicing: bool = False, *, vae_tiling: bool = False, offload: str = "none",
                 attention_backend: str | None = None, torch_compile: bool = False, compile_backend: str = "inductor",
                 components: str = "all", loras: dict[str, str] | None = None, max_loaded_loras: int = 4,
                 max_loras: int = 4, lora_max_rank: int = 64):
        checkpoint = resolve_checkpoint(name, path)
        self.name = name
        self.family_name = family or detect_family(checkpoint)
        options = {"dual_transformer": dual_transformer} if dual_transformer else {}
        self.family: ModelFamily = load_family(self.family_name, checkpoint, torch_dtype=DTYPES[dtype],
                                               device=device, components=components, vae_slicing=vae_slicing,
                                               **options)
        self.components = components
        self.vae_tiling = vae_tiling
        vae = getattr(self.family.pipe, "vae", None)
        if vae_tiling and vae is not None:
            if not hasattr(vae, "enable_tiling"):
                raise ValueError(f"model.vae.tiling: {type(vae).__name__} has no tiled decode")
            vae.enable_tiling()
        problems = offload_problems(offload, boundary_experts=self.family.dual_mode == DualMode.BOUNDARY,
                                    torch_compile=torch_compile)
        if problems:
            raise ValueError("; ".join(problems))
        self.offload = apply_offload(offload, self.family.transformers, self.family.device)
        self.default_kernel = attention_backend
        self.torch_compile = torch_compile
        self.compile_backend = compile_backend
        if torch_compile:
            configure_compile(torch.device(self.family.device))
        self.rank, self.world_size = 0, 1
        self.parallel = None  # parallel.config.ParallelConfig of a multi-rank replica
        self.parallel_vae = False  # the ranks share each tiled decode (parallel.vae)
        self.cfg = None  # parallel.cfg.CfgParallel when cfg_degree is 2
        transformers = self.family.transformers
        hotswap = (max_loras, lora_max_rank, dict(loras)) if torch_compile and loras else None
        self.lora = LoraAdapters(self.family.pipe, transformers["transformer"], max_loaded_loras, hotswap=hotswap,
                                 compiled=torch_compile)
        for adapter, adapter_path in (loras or {}).items():
            self.lora.check(adapter, adapter_path)
        self.cache = {name: CacheDiTExecutor(module) for name, module in transformers.items()}
        self.attention = AttentionSwitch(list(transformers.values()))
        self.state = ReplicaState()
        self.events: deque[tuple] = deque(maxlen=EVENTS_KEPT)  # (batch id, action kind, target), newest last
        self.compiles = 0
        # of the last batch: transformer -> the step indices of its forwards that count (as on one rank)
        self.run_steps: dict[str, list[int]] = {}
        self.guide_cached: dict[str, int] = {}  # of the last batch, under CFG parallelism: group 1's counts
        self.last_transitions: dict[str, CacheTransition] = {}
        self.last_lora_loads = 0  # adapters the last batch loaded from disk
        if attention_backend is not None:
            self.check_default_kernel()
            self._execute("startup", Action(ActionKind.SWITCH_KERNEL, attention_backend), None, None)

    def check_default_kernel(self, ring_degree: int = 1) -> None:
        """Refuse to start with a default kernel (``acceleration.attention_backend``) that no
        batch could run, by the rules a request's override is checked with
        (``pipeline.attention.default_kernel_problems``). Raises ``ValueError`` naming the
        kernel and every reason."""
        if self.default_kernel is None:
            return
        problems = default_kernel_problems(self.default_kernel, device=torch.device(self.family.device),
                                           dtype=self.family.dtype, ring_degree=ring_degree,
                                           masked=self.family.masked_attention)
        if problems:
            raise ValueError(f"acceleration.attention_backend={self.default_kernel!r} cannot run on this replica "
                             f"({self.family.device}, {str(self.family.dtype).removeprefix('torch.')}): "
                             + "; ".join(problems))

    # -- what the Ingress and the Router see -------------------------------------------------
    def facts(self, ring_degree: int = 1, max_steps: int = 100) -> ModelFacts:
        """The model's facts for request validation (``pipeline.wire.ModelFacts``); SCM preset
        step counts are tabled up to ``max_steps``."""
        device, dtype = torch.device(self.family.device), self.family.dtype
        rejections = {name: replica_kernel_rejections(name, device=device, dtype=dtype,
                                                      torch_compile=self.torch_compile,
                                                      num_layers=len(self.attention.layers), ring_degree=ring_degree,
                                                      masked=self.family.masked_attention)
                      for name in KERNELS}
        return ModelFacts(
            family=self.family_name, spatial_factor=self.family.spatial_factor,
            guidance_embeds=self.family.guidance_embeds, num_blocks=self.family.num_blocks,
            longest_block_list=self.family.longest_block_list,
            attention_rejections={k: v for k, v in rejections.items() if v},
            world_size=1 if self.parallel is None else self.parallel.sp_degree,
            cfg_degree=1 if self.parallel is None else self.parallel.cfg_degree,
            text_tokens=self.family.max_sequence_length, guidance_style=self.family.guidance_style,
            dual_mode=self.family.dual_mode, temporal_factor=self.family.temporal_factor,
            boundary_ratio=self.family.boundary_ratio, special_tokens=self.family.special_tokens,
            scm_preset_steps=preset_step_counts(max_steps), input_modes=tuple(self.family.input_modes),
            max_input_images=self.family.max_input_images, cfg_threshold=self.family.cfg_threshold,
            min_steps=self.family.min_steps, true_cfg_default=self.family.true_cfg_default,
            sequence_multiple=self.family.sequence_multiple, requires_image=self.family.requires_image,
            max_side=self.family.max_side, max_latent_frames=self.family.max_latent_frames,
            max_aspect_ratio=self.family.max_aspect_ratio)

    def counters(self) -> dict:
        """Cumulative counts for ``/v1/stats``: state actions, and with torch.compile dynamo's
        record of this process (``compat.torch.dynamo_counts``: graphs compiled, frames that hit
        the recompile limit and run uncompiled)."""
        total = {"compiles": self.compiles, "attention_switches": self.attention.switches, **self.lora.counters,
                 **(self.cfg.counters if self.cfg is not None else {})}
        if self.offload is not None:
            total["offload_moves"] = self.offload.moves
        if self.torch_compile:
            total.update(torch_compat.dynamo_counts())
        for executor in self.cache.values():
            for key, value in executor.counters.items():
                total[key] = total.get(key, 0) + value
        return total

    def parameter_bytes(self) -> int:
        """Bytes of this rank's loaded weights (``/v1/stats``: ``parameter_bytes_per_rank``)."""
        return self.family.parameter_bytes()

    def state_report(self) -> dict:
        """The state for ``/v1/stats``: the primary transformer's Cache-DiT key and the kernel."""
        key = self.state.cache_key("transformer")
        return {"cache_dit_key": None if key is None else key.params.model_dump(exclude_none=True),
                "attention_backend": self.state.attention_backend or "default",
                "loras_active": [f"{s.name}:{s.scale:g}" for s in self.state.loras],
                "loras_loaded": self.lora.loaded_names()}

    # -- the state transition ----------------------------------------------------------------
    def wanted_state(self, head: SamplingParams, schedule: BatchSchedule) -> ReplicaState:
        """The state a batch like ``head`` needs: its kernel, a Cache-DiT key for each
        transformer that runs in it, every transformer compiled when torch.compile is on."""
        separate_cfg = {} if self.cfg is not None else schedule.separate_cfg  # CFG parallel: one call per step
        cache = tuple(sorted(
            (name, None if head.cache_dit_params is None
             else CacheKey(head.cache_dit_params.for_transformer(name).canonical(), separate_cfg.get(name, False)))
            for name, steps in self.cache_steps(schedule).items() if steps))
        compiled = frozenset(self.family.transformers) if self.torch_compile else frozenset()
        return ReplicaState(head.attention_backend or self.default_kernel, cache, compiled, head.lora)

    def cache_steps(self, schedule: BatchSchedule) -> dict[str, list[int]]:
        """Per transformer, the step indices it runs on this rank, which its Cache-DiT context is
        sized for: the schedule's; under CFG parallelism every step (a lockstep batch keeps
        making the guiding forward after the CFG gate, ``parallel.cfg``)."""
        if self.cfg is None:
            return schedule.run_steps
        return steps_per_transformer(schedule.plan, len(schedule.plan))

    def _execute(self, batch_id: str, action: Action, head: SamplingParams | None,
                 schedule: BatchSchedule | None) -> None:
        logger.info("batch %s: %s %s", batch_id, action.kind, action.target or "default")
        kind, name = action.kind, action.target
        if kind == ActionKind.SET_LORAS:
            from parallel.sharding import sequence_split_suspended

            try:  # diffusers' split/gather hooks come off and go back on the layers LoRA wraps (proj_out)
                with sequence_split_suspended(self.family.transformers["transformer"]):
                    self.lora.activate(action.loras)
            except Exception:
                self.state = after(self.state, Action(ActionKind.SET_LORAS, None))  # activate left the base model
                raise
        elif kind == ActionKind.SWITCH_KERNEL:
            self.attention.apply(self.attention.prepare(name))  # prepare may raise; apply cannot
        elif kind == ActionKind.COMPILE:
            self.family.transformers[name].compile(backend=self.compile_backend)
            self.compiles += 1
        else:
            try:
                executor, steps = self.cache[name], len(schedule.timesteps)  # the steps that run (strength)
                if kind == ActionKind.UNMOUNT:
                    executor.unmount()
                elif kind == ActionKind.REFRESH:
                    executor.refresh(action.key, steps, self.cache_steps(schedule)[name])
                else:
                    executor.mount(action.key, steps, self.cache_steps(schedule)[name],
                                   remount=kind == ActionKind.REMOUNT)
            except Exception:
                self.reset_cache()
                raise
        self.state = after(self.state, action)
        self.events.append((batch_id, kind, name))

    def prepare_state(self, batch_id: str, head: SamplingParams, schedule: BatchSchedule) -> None:
        """Move this rank to the state the batch wants, executing ``plan_transition``'s actions.
        Raises ``LoraLoadError`` when an adapter fails to load, else ``StateTransitionError``
        (chained to the action's error) for any failed action (a failed Cache-DiT action leaves
        every transformer unmounted)."""
        self.run_steps = schedule.run_steps
        loads = self.lora.counters["lora_loads"]
        wanted = self.wanted_state(head, schedule)
        actions = plan_transition(self.state, wanted)
        for action in actions:
            try:
                self._execute(batch_id, action, head, schedule)
            except AdapterLoadError as exc:
                logger.error("batch %s: %s", batch_id, exc)
                raise about_adapter(LoraLoadError(f"LoRA adapter {exc.adapter!r} could not be loaded ({exc.public}); "
                                                  "it was unloaded and the replica keeps serving", param="lora",
                                                  code="lora_load_failed"), exc.adapter) from None
            except Exception as exc:
                raise StateTransitionError(f"{action.kind} {action.target or 'default'} failed: "
                                           f"{type(exc).__name__}: {exc}") from exc
        done = {a.target: CacheTransition(a.kind.value) for a in actions
                if a.kind not in (ActionKind.SET_LORAS, ActionKind.SWITCH_KERNEL, ActionKind.COMPILE)}
        self.last_transitions = {name: done.get(name, CacheTransition.NONE) for name, _ in wanted.cache_dit}
        self.last_lora_loads = self.lora.counters["lora_loads"] - loads

    def reset_cache(self) -> None:
        """Unmount Cache-DiT everywhere (after a failure): the exact forward path."""
        for executor in self.cache.values():
            executor.reset()
        self.state = self.state.unmounted()

    # -- one batch ----------------------------------------------------------------------------
    def warmup(self, head: SamplingParams) -> None:
        """Run one batch with the server's default settings, so Cache-DiT is mounted (when
        it is the default) before torch.compile traces the path real requests take."""
        self.run(Batch("warmup", BatchSignature.of(head), (head,)))

    def enable_parallel(self, config, mesh, rank: int) -> None:
        """Make this runner rank ``rank`` of a multi-rank replica (after joining the group): its
        sequence sharded across its CFG group's ``sp_degree`` ranks (the family's
        ``enable_sequence_parallel``), CFG parallelism across the ``cfg_degree`` groups
        (``parallel.cfg``). Raises ``ValueError`` when the layout cannot serve this model."""
        problems = config.startup_problems(num_heads=self.family.num_attention_heads)
        paired = paired_sharding_problem(shard_weights=config.shard_weights, cfg_degree=config.cfg_degree,
                                         dual_mode=self.family.dual_mode)
        problems += [paired] if paired else []
        if problems:
            raise ValueError("; ".join(problems))
        self.check_default_kernel(config.ring_degree)
        self.rank = rank
        self.world_size = config.world_size
        self.parallel = config
        if config.sp_degree > 1:
            self.family.enable_sequence_parallel(config.sequence_layout(), mesh, rank % config.sp_degree)
            self.attention = AttentionSwitch(list(self.family.transformers.values()))  # the processors were replaced
            if self.state.attention_backend is not None:
                self.attention.apply(self.attention.prepare(self.state.attention_backend))
        if config.cfg_degree > 1:
            from compat.cache_dit import reduce_decisions_over
            from parallel.cfg import CfgParallel, sequence_parallel_group

            self.cfg = CfgParallel(mesh["cfg"].get_group(), rank // config.sp_degree)
            if not config.shard_weights:
                # each CFG group decides Cache-DiT for its own branch, as one rank does (separate
                # CFG); sharded weights are gathered by every rank for every block it runs, so
                # there all ranks keep one decision (cache-dit's own reduce over all of them)
                reduce_decisions_over(sequence_parallel_group(config, rank), config.sp_degree)
        vae = getattr(self.family.pipe, "vae", None)
        if self.vae_tiling and vae is not None:  # every rank loaded the VAE (components "denoiser+vae")
            from parallel.vae import supports

            self.parallel_vae = supports(vae)
            if not self.parallel_vae and rank != 0:
                self.family.pipe.vae = None  # no tile-parallel decode for this VAE: rank 0 decodes alone
        if config.shard_weights:
            from parallel.fsdp import shard_transformer, weight_mesh

            everyone = weight_mesh(None)  # every rank of the replica shares every transformer's weights
            for transformer in self.family.transformers.values():
                shard_transformer(transformer, everyone)

    def boundary_checks(self, batch: Batch, should_stop=None, requests_gone=None):
        """The loop's per-step decisions ``(should_stop, rows_gone)`` for ``batch``, from this
        rank's ``should_stop()`` (stop the whole batch) and ``requests_gone()`` (request ids
        nobody waits for). On several ranks every rank's wishes are agreed by all
        (``parallel.groups.agree_at_boundary``: one small all-reduce per step, every rank
        calling it), so every rank stops, or drops the same rows, at the same step."""
        ids = [p.request_id for p in batch.requests]
        agreed: dict[str, set[int]] = {"gone": set()}

        def local() -> tuple[bool, set[int]]:
            stop = bool(should_stop()) if should_stop is not None else False
            gone = set(requests_gone()) if requests_gone is not None else set()
            return stop, {i for i, r in enumerate(ids) if r in gone}

        def stop() -> bool:
            wish, gone = local()
            if self.world_size > 1:
                from parallel.groups import agree_at_boundary

                wish, gone = agree_at_boundary(wish, gone, len(ids))
            agreed["gone"] = gone
            return wish

        if self.world_size == 1 and should_stop is None and requests_gone is None:
            return None, None
        return stop, lambda: agreed["gone"]

    def denoise(self, batch: Batch, on_step=None, should_stop=None, on_preview=None,
                requests_gone=None) -> LoopOutput:
        """Move the state to the batch's signature and run the loop. Images (float32 in [0, 1],
        (n, H, W, 3) per request, (n, F, H, W, 3) for videos) only on rank 0. ``should_stop()``:
        this rank's wish to stop at a step boundary (``pipeline.loop.BatchCancelled``);
        ``requests_gone()``: ids of the batch's requests nobody waits for, whose rows are dropped
        at the next step boundary (not while Cache-DiT runs: its buffers hold every row's
        residuals, so such a batch runs its rows to the end and only a whole-batch stop saves
        work). Raises ``StateTransitionError`` when the state cannot be reached (``LoraLoadError``
        for an adapter that fails to load), else whatever the model or cache-dit raises, after
        leaving Cache-DiT unmounted, with the rows dropped before it noted on it
        (``pipeline.errors.dropped_rows``)."""
        head = batch.requests[0]
        schedule = plan_batch(self.family, head)
        self.prepare_state(batch.batch_id, head, schedule)
        caching = any(key is not None for _, key in self.state.cache_dit)
        if self.cfg is not None:  # see parallel.cfg: lockstep for sharded weights (same collectives) and Cache-DiT
            self.cfg.lockstep = self.parallel.shard_weights or caching
        stop, gone = self.boundary_checks(batch, should_stop, requests_gone)
        if caching:
            gone = None  # same state on every rank: every rank keeps the rows
        dropped: dict[int, int] = {}
        self.guide_cached = {}
        try:
            out = denoise_batch(self.family, list(batch.requests), schedule, on_step=on_step,
                                 on_guide_skipped=self._guide_skipped if self.cfg is None else None,
                                 decode=self.rank == 0, on_preview=on_preview,
                                 should_stop=stop, rows_gone=gone,
                                 encode=conditioning if self.world_size == 1 else self._shared_conditioning,
                                 prepare=initial_latents if self.world_size == 1 else self._shared_latents,
                                 branches=self.cfg, vae_decode=self._parallel_decode if self.parallel_vae else None,
                                 dropped=dropped)
            guide_only = {s.guide for s in schedule.plan if s.guide} - {s.model for s in schedule.plan}
            if self.cfg is not None and caching and guide_only:  # the same on every rank
                # after the gate group 1's forwards are unused (lockstep): the steps before it count
                self.guide_cached = self.cfg.guide_cached_steps(
                    {name: self.cache[name].cached_steps(before=schedule.gate_at) for name in sorted(guide_only)},
                    torch.device(self.family.device))
            return out
        except BatchCancelled:
            raise  # contexts are refreshed by the next batch; nothing was left half-mounted
        except Exception as exc:
            record_dropped_rows(exc, dropped)  # first: reset_cache may raise in its place
            try:
                self.reset_cache()
            except Exception as reset_failed:
                record_dropped_rows(reset_failed, dropped)
                raise reset_failed from exc
            raise

    def _shared_conditioning(self, family, batch, plan):
        """``pipeline.loop.conditioning`` on a sequence-parallel replica: rank 0 encodes and
        broadcasts the result (on the host) to every rank, which needs no text encoder. A
        failure of the encode itself reaches every rank as :class:`SharedFailure`, so all
        ranks end the batch the same way and the group stays in step."""
        from parallel.groups import broadcast_object

        if self.rank == 0:
            try:
                keep, cond, uncond, failures = conditioning(family, batch, plan)
            except Exception as exc:
                broadcast_object(("error", f"{type(exc).__name__}: {exc}"))
                raise SharedFailure(f"encoding the batch's prompts failed: {type(exc).__name__}: {exc}") from exc
            broadcast_object(("ok", keep, None if cond is None else cond.to("cpu"),
                              None if uncond is None else uncond.to("cpu"),
                              {i: field for i, (field, _) in failures.items()}))
            return keep, cond, uncond, failures
        payload = broadcast_object(None)
        if payload[0] == "error":
            raise SharedFailure(f"encoding the batch's prompts failed on rank 0: {payload[1]}")
        _, keep, cond, uncond, fields = payload
        device = self.family.device
        return (keep, None if cond is None else cond.to(device), None if uncond is None else uncond.to(device),
                {i: (field, None) for i, field in fields.items()})

    def _shared_latents(self, family, kept, schedule):
        """``pipeline.loop.initial_latents`` on a sequence-parallel replica. Noise alone is drawn
        on every rank (same seeds, same values); image inputs need the VAE, which only rank 0
        has, so rank 0 prepares them and broadcasts the latents and conditioning (on the host).
        A failure on rank 0 reaches every rank as :class:`SharedFailure`."""
        from parallel.groups import broadcast_object

        if kept[0].input_mode == InputMode.TEXT:
            return initial_latents(family, kept, schedule)
        if self.rank == 0:
            try:
                latents, positions = initial_latents(family, kept, schedule)
            except Exception as exc:
                broadcast_object(("error", f"{type(exc).__name__}: {exc}"))
                raise SharedFailure(f"preparing the batch's input images failed: {type(exc).__name__}: {exc}") from exc
            broadcast_object(("ok", latents.to("cpu"), None if positions is None else positions.to("cpu")))
            return latents, positions
        payload = broadcast_object(None)
        if payload[0] == "error":
            raise SharedFailure(f"preparing the batch's input images failed on rank 0: {payload[1]}")
        _, latents, positions = payload
        device = self.family.device
        return latents.to(device), None if positions is None else positions.to(device)

    def _parallel_decode(self, vae, z):
        """The VAE's decode of ``z`` shared by every rank (``parallel.vae``): each decodes its
        tiles and rank 0 blends them, the pixels of one rank's tiled decode. Latents within one
        tile are decoded by rank 0 alone, as diffusers would (no tiling). None on other ranks."""
        from parallel.vae import parallel_tiled_decode, tiles_needed

        if tiles_needed(vae, z):
            return parallel_tiled_decode(vae, z, self.rank, self.world_size)
        return vae.decode(z, return_dict=False)[0] if self.rank == 0 else None

    def _guide_skipped(self, name: str) -> None:
        self.cache[name].skip_guide_call(self.state.cache_key(name))

    def run(self, batch: Batch, on_step=None, should_stop=None, on_preview=None,
            requests_gone=None) -> list[RequestOutput]:
        """``denoise`` then encode: one RequestOutput per request, in batch order (none on
        ranks other than 0); a request whose rows were dropped (``requests_gone``) has no media
        and ``dropped_at_step`` set. ``on_preview(event)``: the streamed previews of requests with
        ``partial_images``, each ``{"request_id", "partial_image_index", "images": [encoded]}``
        in the request's ``output_format`` (a video's first frame: WebP, as its thumbnail). The
        caller answers every request of a failed batch."""
        head = batch.requests[0]

        video = head.num_frames > 1 or self.family.temporal_factor > 0

        def preview(index: int, partial: int, images) -> None:
            p = batch.requests[index]
            try:
                encoded = [encode_image(v, VIDEO_IMAGE_FORMAT, 90) if video else
                           encode_image(v, p.output_format, p.output_compression) for v in images]
            except Exception:  # its final image meets the same failure, alone (_outputs): the batch goes on
                logger.exception("request %s: preview %d could not be encoded", p.request_id, partial)
                return
            on_preview({"request_id": p.request_id, "partial_image_index": partial, "images": encoded})

        wanted = on_preview is not None and any(p.partial_images for p in batch.requests)
        out = self.denoise(batch, on_step, should_stop, preview if wanted else None, requests_gone)
        if self.rank != 0:
            return []
        try:
            return self._outputs(batch, out, video)
        except Exception as exc:  # encoding failed: the rows dropped before are still named
            record_dropped_rows(exc, out.dropped or {})
            raise

    def _outputs(self, batch: Batch, out: LoopOutput, video: bool) -> list[RequestOutput]:
        """``run``'s encoding of ``out`` (rank 0): one RequestOutput per request of ``batch``."""
        head = batch.requests[0]
        t0 = time.perf_counter()
        # a NaN decodes to black, +inf to white: such a request is answered as a failure, not with that image
        decoded_non_finite = {i for i, samples in enumerate(out.images)
                              if samples is not None and not all(np.isfinite(v).all() for v in samples)}
        non_finite = (out.non_finite or set()) | decoded_non_finite
        images = [None if i in non_finite else samples for i, samples in enumerate(out.images)]
        media, thumbnails, unencoded = [], [], {}
        for i, (p, samples) in enumerate(zip(batch.requests, images, strict=True)):
            items = thumbs = None
            try:
                if samples is not None:
                    items = [encode_mp4(v, p.fps) if video else encode_image(v, p.output_format, p.output_compression)
                             for v in samples]
                    thumbs = [encode_image(v[0], VIDEO_IMAGE_FORMAT, 90) for v in samples] if video else None
            except Exception as exc:  # its own size or format: its batch-mates keep their media
                logger.exception("request %s: its output could not be encoded", p.request_id)
                unencoded[i] = exc
                items = thumbs = None
            media.append(items)
            thumbnails.append(thumbs)
        encode_ms = (time.perf_counter() - t0) * 1e3
        report = self._report(head, out)
        timings = {"denoise": out.denoise_ms, "decode": out.decode_ms + encode_ms}
        failures, dropped = out.failures or {}, out.dropped or {}
        outputs = []
        for i, (p, items) in enumerate(zip(batch.requests, media, strict=True)):
            # its own cfg_gate_step: batch-mates' fractions may differ where they gate at one step
            acceleration = report.model_copy(update={"cfg_gate": CfgGateReport(
                gate_step=p.cfg_gate_fraction, reused_steps=out.cfg_reused_steps)})
            if i in dropped:
                outputs.append(RequestOutput(p.request_id, p.seed, [], dict(timings), acceleration,
                                             dropped_at_step=dropped[i]))
            elif i in failures:
                field, exc = failures[i]
                error = InvalidRequestError(
                    f"{field} of request {p.request_id} could not be encoded by the model's tokenizer "
                    f"({type(exc).__name__}); the other requests of its batch ran", param=field,
                    code="unprocessable_text", request_id=p.request_id)
                outputs.append(RequestOutput(p.request_id, p.seed, [], dict(timings), acceleration, error=error))
            elif i in unencoded:
                what = (f"an MP4 with a {VIDEO_IMAGE_FORMAT} thumbnail" if video
                        else f"{p.output_format}") + f" at {p.width}x{p.height}"
                error = OutputEncodingError(
                    f"the output of request {p.request_id} could not be encoded as {what} "
                    f"({type(unencoded[i]).__name__}); the other requests of its batch ran",
                    code="encoding_failed", request_id=p.request_id)
                outputs.append(RequestOutput(p.request_id, p.seed, [], dict(timings), acceleration, error=error))
            elif i in non_finite:
                error = InternalError(
                    f"the model's output for request {p.request_id} holds NaN or infinite values (a numerical "
                    f"overflow, or an adapter's weights); the other requests of its batch ran",
                    code="non_finite_output", request_id=p.request_id)
                outputs.append(RequestOutput(p.request_id, p.seed, [], dict(timings), acceleration, error=error))
            else:
                outputs.append(RequestOutput(p.request_id, p.seed, thumbnails[i] if video else items, dict(timings),
                                             acceleration, videos=items if video else []))
        return outputs

    def _report(self, head: SamplingParams, out: LoopOutput) -> AccelerationReport:
        """The batch's acceleration report (``cfg_gate`` left to each request: ``_outputs``)."""
        # a guide-only transformer under CFG parallelism ran on group 1 (``parallel.cfg``)
        cached = {name: self.guide_cached.get(name, executor.cached_steps()) for name, executor in self.cache.items()}
        transitions = self.last_transitions
        main = transitions.get("transformer", CacheTransition.NONE)
        if main == CacheTransition.NONE:
            main = next((t for t in transitions.values() if t != CacheTransition.NONE), CacheTransition.NONE)
        per_transformer = None
        if len(self.cache) > 1:
            per_transformer = {
                name: TransformerCacheReport(active=self.state.cache_key(name) is not None,
                                             transition=transitions.get(name, CacheTransition.NONE),
                                             steps=len(self.run_steps.get(name, [])), cached_steps=cached[name])
                for name in self.cache}
        # the primary's steps: a boundary expert runs only its side of the schedule (helper-55: 13
        # "computed" of 16 where the primary computed 2 of its 5); none when boundary_ratio leaves it none
        primary_steps = len(self.run_steps.get("transformer", []))
        cache = CacheDiTReport(active=self.state.cache_key("transformer") is not None, transition=main,
                               cached_steps=cached["transformer"], computed_steps=primary_steps - cached["transformer"],
                               transformers=per_transformer)
        return AccelerationReport(cache_dit=cache, attention_backend=self.state.attention_backend or "default",
                                  transformer_calls=out.calls or {},
                                  lora=LoraReport(active=[f"{s.name}:{s.scale:g}" for s in head.lora],
                                                  loads=self.last_lora_loads))
