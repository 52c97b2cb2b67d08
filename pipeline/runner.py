"""The replica-side batch runner: loads a checkpoint and turns a Batch into per-request outputs.

It owns the model and the acceleration state of one rank and never decides what runs next.
Per batch, in the design's order: 1 attention override (prepare, then flip all layers),
2 Cache-DiT transition, 3 torch.compile (once per module, after Cache-DiT is mounted),
4 the denoising loop, 5 decode. PNG encoding happens here so no tensor reaches the router.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.attention import KERNELS, AttentionSwitch, kernel_rejections
from pipeline.cache_dit_state import CacheDiTState
from pipeline.contract import ServingLimits, parse_size
from pipeline.families import detect_family, load_family
from pipeline.loop import denoise_batch, gate_step, separate_cfg_of, step_plan, steps_per_transformer
from pipeline.media import encode_mp4, encode_png
from pipeline.sampling import SamplingParams
from pipeline.signature import BatchSignature
from pipeline.tiny.build import EMBEDDED


@dataclass(frozen=True)
class Batch:
    """What the router sends a replica: one signature, requests in queue order."""

    batch_id: str
    signature: BatchSignature
    requests: tuple[SamplingParams, ...]
    preferred_replica: str | None = None  # the router's choice; Serve's request router honours it if free

    @property
    def size(self) -> int:
        """Images in the batch (a request with ``n`` counts ``n``)."""
        return sum(p.n for p in self.requests)


@dataclass
class RequestOutput:
    """One request's answer from a replica: PNG bytes of its ``n`` images (or MP4 bytes of
    its videos) and metadata parts."""

    request_id: str
    seed: int
    pngs: list[bytes]
    timings_ms: dict[str, float]
    acceleration: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)  # batch_id, batch_size, signature, replica, ...
    videos: list[bytes] = field(default_factory=list)  # MP4 (H.264) per video


@dataclass(frozen=True)
class ModelFacts:
    """What the ingress needs to validate requests without loading the model.

    ``num_blocks``: transformer blocks cache-dit sees (bounds Fn + Bn).
    ``attention_rejections``: per request-switchable kernel, why it cannot run here.
    """

    family: str
    spatial_factor: int
    guidance_embeds: bool
    num_blocks: int = 0
    attention_rejections: dict = field(default_factory=dict)
    world_size: int = 1
    text_tokens: int = 0
    cfg_style: str = "true_cfg"
    dual_mode: str | None = None
    temporal_factor: int = 0  # 0: an image model
    boundary_ratio: float | None = None

    def limits(self, model_name: str, limits: dict) -> ServingLimits:
        """The validation context: these facts plus the config's ``limits`` section
        (``deployments.config.LimitsConfig`` as a dict)."""
        width, height = parse_size(limits["default_size"])
        return ServingLimits(
            model_name=model_name, spatial_factor=self.spatial_factor, default_width=width, default_height=height,
            default_steps=limits["default_steps"], default_guidance_scale=limits["default_guidance_scale"],
            max_n=limits["max_n"], max_pixels=limits["max_pixels"], max_steps=limits["max_steps"],
            max_prompt_chars=limits["max_prompt_chars"], guidance_embeds=self.guidance_embeds,
            num_blocks=self.num_blocks, attention_rejections=self.attention_rejections, world_size=self.world_size,
            cfg_style=self.cfg_style, dual_mode=self.dual_mode, temporal_factor=self.temporal_factor,
            default_num_frames=limits["default_num_frames"], default_fps=limits["default_fps"],
            max_frames=limits["max_frames"], default_boundary_ratio=self.boundary_ratio)


def resolve_checkpoint(name: str, path: str | None) -> Path | str:
    """The checkpoint to load: ``path`` if given, else the embedded model of that name
    (``tiny-flux`` trained and shipped; ``tiny-flux-random``, ``tiny-wan``, ``tiny-wan-moe``, ``tiny-wan-paired``
    built on first use).
    Raises ``FileNotFoundError`` for a ``path`` that is neither a local diffusers directory
    nor (where the machine is online) a hub id."""
    if path is None:
        if name not in EMBEDDED:
            raise FileNotFoundError(f"model {name!r} needs a checkpoint path (embedded: {', '.join(EMBEDDED)})")
        return EMBEDDED[name]()
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "model_index.json").exists():
            raise FileNotFoundError(f"{local} is not a diffusers checkpoint (no model_index.json)")
        return local
    return path


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BatchRunner:
    """Loads one checkpoint and runs signature-homogeneous batches on it, one at a time.

    ``attention_backend``: the server's default kernel (None: diffusers' default, torch SDPA).
    ``torch_compile``: compile each transformer once, after Cache-DiT is mounted when wanted;
    ``compile_backend`` is ``torch.compile``'s backend ("inductor"; "eager" for cheap tests).
    ``dual_transformer``: the execution mode of a second transformer (Wan: ``boundary`` or
    ``paired``; None: what the checkpoint declares).
    """

    def __init__(self, name: str, path: str | None = None, family: str | None = None,
                 dtype: str = "float32", device: str = "cpu", dual_transformer: str | None = None, *,
                 attention_backend: str | None = None, torch_compile: bool = False,
                 compile_backend: str = "inductor"):
        checkpoint = resolve_checkpoint(name, path)
        self.name = name
        self.family_name = family or detect_family(checkpoint)
        options = {"dual_transformer": dual_transformer} if dual_transformer else {}
        self.family = load_family(self.family_name, checkpoint, torch_dtype=DTYPES[dtype], device=device,
                                  **options)
        transformers = list(self.family.transformers.values())
        self.cache = CacheDiTState(self.family.transformers)
        self.attention = AttentionSwitch(transformers, default=attention_backend)
        self.torch_compile = torch_compile
        self.compile_backend = compile_backend
        self.compiled: set[int] = set()
        self.events: list[tuple] = []  # (what, detail) in order: mounts and compiles, for audits
        self.compiles = 0
        self.rank, self.world_size = 0, 1
        self.run_steps: dict[str, list[int]] = {}  # of the last batch: transformer -> step indices

    def facts(self, ring_degree: int = 1) -> ModelFacts:
        device, dtype = self.family.device, self.family.dtype
        layers = len(self.attention.layers)
        blocks = min(sum(len(getattr(t, a, ())) for a in ("transformer_blocks", "single_transformer_blocks", "blocks"))
                     for t in self.family.transformers.values())
        rejections = {name: kernel_rejections(name, device=torch.device(device), dtype=dtype,
                                              torch_compile=self.torch_compile, num_layers=layers,
                                              ring_degree=ring_degree)
                      for name in KERNELS}
        return ModelFacts(self.family_name, self.family.spatial_factor, self.family.guidance_embeds, blocks,
                          {k: v for k, v in rejections.items() if v}, self.world_size,
                          self.family.sequence_lengths(0, 0)["text tokens"], self.family.cfg_style,
                          self.family.dual_mode, self.family.temporal_factor, self.family.boundary_ratio)

    def counters(self) -> dict:
        return {**self.cache.counters, "compiles": self.compiles, "attention_switches": self.attention.switches}

    def state(self) -> dict:
        active = self.cache.active
        return {"cache_dit_key": None if active is None else dict(active.overrides),
                "attention_backend": self.attention.active or "default"}

    def plan(self, head: SamplingParams):
        """Which transformer runs which step of a batch like ``head`` (``pipeline.loop.step_plan``)."""
        if self.family.dual_mode == "boundary":
            scheduler, timesteps = self.family.scheduler_and_timesteps(head.num_inference_steps, None)
            return step_plan(timesteps, head, "boundary", self.family.boundary_ratio,
                             scheduler.config.num_train_timesteps)
        return step_plan(range(head.num_inference_steps), head, self.family.dual_mode)

    def _prepare_state(self, head: SamplingParams) -> str:
        prepared = self.attention.prepare(head.attention_backend)  # may raise; changes nothing
        self.attention.apply(prepared)
        plan = self.plan(head)
        self.run_steps = steps_per_transformer(plan, gate_step(head, len(plan)))
        overrides = (head.cache_dit_params or ()) if head.enable_cache_dit else None
        transition = self.cache.apply(overrides, head.num_inference_steps, self.run_steps, separate_cfg_of(plan))
        if transition in ("mount", "remount"):
            self.events.append(("mount", transition))
        if self.torch_compile:
            for name, module in self.family.transformers.items():
                if id(module) not in self.compiled:
                    module.compile(backend=self.compile_backend)
                    self.compiled.add(id(module))
                    self.compiles += 1
                    self.events.append(("compile", name, self.cache.active is not None))
        return transition

    def warmup(self, head: SamplingParams) -> None:
        """Run one batch with the server's default settings, so Cache-DiT is mounted (when
        it is the default) before torch.compile traces the path real requests take."""
        self.run(Batch("warmup", BatchSignature.of(head), (head,)))

    def enable_sequence_parallel(self, config, mesh, rank: int) -> None:
        """Make this runner one rank of a sequence-parallel replica (after joining the group).
        Raises ``ValueError`` when the layout cannot serve this model."""
        problems = config.startup_problems(num_heads=self.family.num_attention_heads)
        if problems:
            raise ValueError("; ".join(problems))
        self.rank = rank
        self.world_size = config.world_size
        self.family.enable_sequence_parallel(config, mesh, rank)
        self.attention = AttentionSwitch(list(self.family.transformers.values()), default=self.attention.default)

    def denoise(self, batch: Batch, on_step=None):
        """Move the acceleration state to the batch's signature and run the loop.

        Returns ``(LoopOutput, transition)``; images (float32, (n, H, W, 3) per request) only
        on rank 0. Raises whatever the model or cache-dit raises, after leaving Cache-DiT
        unmounted.
        """
        transition = self._prepare_state(batch.requests[0])
        try:
            out = denoise_batch(self.family, list(batch.requests), on_step=on_step,
                                on_uncond_skipped=self.cache.skip_uncond_slot, decode=self.rank == 0)
        except Exception:
            self.cache.reset()
            raise
        return out, transition

    def run(self, batch: Batch, on_step=None) -> list[RequestOutput]:
        """``denoise`` then PNG-encode: one RequestOutput per request, in batch order (none
        on ranks other than 0). The caller answers every request of a failed batch."""
        head = batch.requests[0]
        out, transition = self.denoise(batch, on_step)
        if self.rank != 0:
            return []
        cached = self.cache.cached_steps()
        t0 = time.perf_counter()
        video = head.num_frames > 1 or self.family.temporal_factor > 0
        media = [[encode_mp4(v, head.fps) if video else encode_png(v) for v in samples] for samples in out.images]
        encode_ms = (time.perf_counter() - t0) * 1e3
        cache = {"active": self.cache.active is not None, "transition": transition,
                 "cached_steps": cached["transformer"], "computed_steps": out.steps - cached["transformer"]}
        if len(self.cache.executors) > 1:
            cache["transformers"] = {
                name: {"active": ex.active is not None, "transition": self.cache.last_transitions.get(name, "none"),
                       "steps": len(self.run_steps.get(name, [])),
                       "cached_steps": cached[name]}
                for name, ex in self.cache.executors.items()}
        acceleration = {
            "cache_dit": cache,
            "attention_backend": self.attention.active or "default",
            "cfg_gate": {"gate_step": head.cfg_gate_step, "reused_steps": out.cfg_reused_steps},
            "transformer_calls": out.calls,
        }
        timings = {"denoise": out.denoise_ms, "decode": out.decode_ms + encode_ms}
        return [
            RequestOutput(p.request_id, p.seed, [] if video else items, dict(timings), acceleration,
                          videos=items if video else [])
            for p, items in zip(batch.requests, media)
        ]

