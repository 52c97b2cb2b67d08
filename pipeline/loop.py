"""Our denoising loop: one batch of requests as one batched forward per step.

Per request: prompt, negative prompt and seed (one generator per request, drawing that
request's ``n`` samples). Shared by the batch (its signature): size, frames, steps,
guidance and CFG mode. Guidance follows diffusers' pipelines: a separate guiding forward
and ``guide + scale · (cond − guide)`` (``FluxPipeline``'s true CFG, ``WanPipeline``'s CFG).

Which transformer runs at a step is the model's execution mode (:func:`step_plan`):

- one transformer (FLUX.1, Wan 2.1): ``transformer`` every step;
- *boundary experts* (Wan 2.2 A14B, diffusers' ``WanPipeline`` with ``boundary_ratio``):
  ``transformer`` for timesteps ``t >= boundary_ratio · num_train_timesteps`` (high noise),
  ``transformer_2`` with ``guidance_scale_2`` below it;
- *paired per step*: ``transformer`` makes the conditional prediction and ``transformer_2``
  the guiding one from the same prompt at every step, as autoguidance (Karras et al. 2024,
  "Guiding a Diffusion Model with a Bad Version of Itself", arXiv:2406.02507).

The schedule (scheduler, timesteps, per-step plan, gate) is decided once per batch by
:func:`plan_batch`; the runner sizes Cache-DiT from it and hands it to :func:`denoise_batch`.

CFG gating (``cfg_gate_step``, a fraction g < 1): after ``max(1, floor(g · steps))`` steps the guiding
forward is skipped and the last computed delta (cond − guide) is reused: the guided prediction is
made from ``cond`` and ``cond − delta`` (``cond + (scale − 1) · delta`` for linear guidance). The idea follows CFG truncation / "CFG-Cache" step skipping
used by xDiT and vLLM-Omni; g = 1 runs every step exactly as without gating.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.errors import BatchCancelled
from pipeline.modes import DualMode, InputMode
from pipeline.sampling import SamplingParams, cfg_gate_at

PRIMARY, SECONDARY = "transformer", "transformer_2"



@dataclass
class LoopOutput:
    """images: one float32 array in [0, 1] per request, in batch order: (n, H, W, 3) for
    images, (n, F, H, W, 3) for videos (empty on sequence-parallel ranks other than 0; None
    for a request in ``failures``). ``denoise_ms``/``decode_ms``: wall time in ms (``denoise_ms``
    includes prompt encoding and the initial latents). ``steps``: denoising steps of the
    schedule (0 when no request's text encoded); ``cfg_reused_steps``: steps whose guiding
    forward CFG gating skipped. ``calls``: transformer name -> forwards run. ``failures``: batch
    index -> (request field, exception) of the requests taken out of the batch because their own
    input failed. ``dropped``: batch index -> steps done when the request's rows were dropped
    (nobody waited for it; no image).
    ``non_finite``: batch indices whose final latents hold NaN or ±inf (a numerical overflow;
    their decoded images are not to be answered: the VAE's post-processing clamps +inf to white)."""

    images: list[np.ndarray | None]
    denoise_ms: float
    decode_ms: float
    steps: int
    cfg_reused_steps: int = 0
    calls: dict | None = None
    failures: dict[int, tuple[str, Exception]] | None = None
    dropped: dict[int, int] | None = None
    non_finite: set[int] | None = None


@dataclass(frozen=True)
class StepPlan:
    """What one denoising step runs.

    ``model``: the transformer making the conditional prediction. ``guide``: the one making
    the guiding prediction (None: no guidance). ``guide_prompt``: ``"negative"`` (CFG on the
    negative prompt) or ``"prompt"`` (autoguidance). ``scale``: the guidance scale.
    """

    model: str
    guide: str | None
    guide_prompt: str
    scale: float


def step_plan(timesteps, head: SamplingParams, dual_mode: DualMode, boundary_ratio: float | None = None,
              num_train_timesteps: int = 1000) -> list[StepPlan]:
    """The per-step plan of a batch (see the module docstring).

    ``boundary_ratio``: the model's default, replaced by ``head.boundary_ratio`` when the
    request gives one. Raises ``ValueError`` for an unknown ``dual_mode``.
    """
    if dual_mode == DualMode.PAIRED:
        return [StepPlan(PRIMARY, SECONDARY, "prompt", head.cfg_scale) for _ in timesteps]
    if dual_mode not in (DualMode.SINGLE, DualMode.BOUNDARY):
        raise ValueError(f"unknown dual-transformer mode {dual_mode!r}")
    boundary_t = None
    if dual_mode == DualMode.BOUNDARY:
        ratio = head.boundary_ratio if head.boundary_ratio is not None else boundary_ratio
        boundary_t = ratio * num_train_timesteps
    plans = []
    for t in timesteps:
        low_noise = boundary_t is not None and float(t) < boundary_t
        model = SECONDARY if low_noise else PRIMARY
        scale = head.cfg_scale
        if low_noise and head.cfg_scale_2 is not None:
            scale = head.cfg_scale_2
        plans.append(StepPlan(model, model if head.guided else None, "negative", scale))
    return plans


def gate_step(head: SamplingParams, num_steps: int) -> int:
    """Index of the first step whose guiding forward CFG gating skips (``num_steps``: none)."""
    return cfg_gate_at(head.cfg_gate_fraction, num_steps)


def steps_per_transformer(plan: list[StepPlan], gate_at: int) -> dict[str, list[int]]:
    """Indices of the steps at which each transformer runs at least one forward (what its
    Cache-DiT context is sized and masked for)."""
    steps: dict[str, list[int]] = {}
    for i, step in enumerate(plan):
        used = [step.model] + ([step.guide] if step.guide not in (None, step.model) and i < gate_at else [])
        for name in used:
            steps.setdefault(name, []).append(i)
    return steps


def separate_cfg_of(plan: list[StepPlan]) -> dict[str, bool]:
    """Per transformer: does it make both the conditional and the guiding forward of a step
    (cache-dit's ``enable_separate_cfg``: two calls per step, told apart by parity)?"""
    out: dict[str, bool] = {}
    for step in plan:
        out[step.model] = out.get(step.model, False) or step.guide == step.model
        if step.guide not in (None, step.model):
            out.setdefault(step.guide, False)
    return out


@dataclass
class BatchSchedule:
    """A batch's schedule, decided once: a fresh ``scheduler`` (stateful: one batch only), its
    ``timesteps``, the per-step ``plan`` and ``gate_at`` (first step whose guiding forward is
    skipped). ``run_steps`` / ``separate_cfg``: what Cache-DiT is sized for, per transformer."""

    scheduler: Any
    timesteps: torch.Tensor
    plan: list[StepPlan]
    gate_at: int

    @property
    def run_steps(self) -> dict[str, list[int]]:
        return steps_per_transformer(self.plan, self.gate_at)

    @property
    def separate_cfg(self) -> dict[str, bool]:
        return separate_cfg_of(self.plan)


def plan_batch(family, head: SamplingParams) -> BatchSchedule:
    """The schedule of a batch whose requests share ``head``'s signature (image-to-image with
    ``strength`` < 1: only the steps that run, ``head.effective_steps``)."""
    scheduler, timesteps = family.scheduler_and_timesteps(head.num_inference_steps, head)
    plan = step_plan(timesteps, head, family.dual_mode, family.boundary_ratio, scheduler.config.num_train_timesteps)
    return BatchSchedule(scheduler, timesteps, plan, gate_step(head, len(plan)))


def check_homogeneous(batch: list[SamplingParams]) -> SamplingParams:
    """The batch's first request; raises ``ValueError`` if the batch is empty or mixes signatures."""
    from pipeline.signature import BatchSignature

    if not batch:
        raise ValueError("empty batch")
    first = BatchSignature.of(batch[0])
    for p in batch[1:]:
        if BatchSignature.of(p) != first:
            raise ValueError(f"batch mixes signatures: {first} vs {BatchSignature.of(p)}")
    return batch[0]


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run every kernel queued so far (CUDA only; CPU work is
    synchronous). Called at step and phase boundaries, never per layer, so progress and the
    ``denoise_ms`` / ``decode_ms`` timings follow the GPU rather than the host enqueueing ahead."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def encode_isolating(family, texts: list[str], images: list[tuple]):
    """Encode ``texts`` (each with its request's input ``images``) in one call; if that fails,
    encode each alone to find the ones that fail.

    Returns ``(conditioning, {})`` or, when some texts fail on their own, ``(None, {index:
    exception})``. Re-raises the batch's error if every text encodes alone (not attributable).
    """
    try:
        return family.encode_prompts(texts, images), {}
    except Exception:
        failures = {}
        for i, (text, own) in enumerate(zip(texts, images, strict=True)):
            try:
                family.encode_prompts([text], [own])
            except Exception as exc:
                failures[i] = exc
        if not failures:
            raise
        return None, failures


def conditioning(family, batch: list[SamplingParams], plan: list[StepPlan]):
    """Encoded prompts (and negative prompts when a step guides on them) of ``batch``, one row
    per sample, with the requests whose own text failed to encode isolated.

    Returns ``(kept batch indices, cond, uncond or None, failures)``; ``failures``: index ->
    (field, exception). Encoding is deterministic, so every rank isolates the same requests.
    """
    negative = any(s.guide is not None and s.guide_prompt == "negative" for s in plan)
    failures: dict[int, tuple[str, Exception]] = {}
    cond, bad = encode_isolating(family, [p.prompt for p in batch], [p.images for p in batch])
    failures.update({i: ("prompt", e) for i, e in bad.items()})
    uncond = None
    if negative:
        uncond, bad = encode_isolating(family, [p.negative_prompt or "" for p in batch], [p.images for p in batch])
        failures.update({i: ("negative_prompt", e) for i, e in bad.items() if i not in failures})
    keep = [i for i in range(len(batch)) if i not in failures]
    if not keep:
        return keep, None, None, failures
    kept = [batch[i] for i in keep]
    index = torch.repeat_interleave(torch.arange(len(kept)), torch.tensor([p.n for p in kept]))
    if failures:  # encode the survivors again, without the failed texts
        images = [p.images for p in kept]
        cond = family.encode_prompts([p.prompt for p in kept], images)
        uncond = family.encode_prompts([p.negative_prompt or "" for p in kept], images) if negative else None
    return keep, cond.select(index), None if uncond is None else uncond.select(index), failures


def initial_latents(family, kept: list[SamplingParams], schedule: BatchSchedule):
    """``family.prepare_latents`` for the requests ``kept`` (one generator per request, seeded
    with its ``seed``): ``(latents, positions)``. Image inputs also get the requests (their
    images) and the schedule (the timestep they are noised to)."""
    head = kept[0]
    generators = [torch.Generator(device="cpu").manual_seed(p.seed) for p in kept]
    counts = [p.n for p in kept]
    if head.input_mode == InputMode.TEXT:
        return family.prepare_latents(generators, counts, head)
    return family.prepare_latents(generators, counts, head, requests=kept, schedule=schedule)


def preview_steps(num_steps: int, partial_images: int) -> list[int]:
    """After which steps (1-based counts of finished steps) a request's ``partial_images``
    previews are made: evenly spaced over the run, before the last step, each at most once
    (short runs make fewer)."""
    steps = {round((k + 1) * num_steps / (partial_images + 1)) for k in range(partial_images)}
    return sorted(s for s in steps if 1 <= s < num_steps)


def x0_prediction(scheduler, latents: torch.Tensor, noise_pred: torch.Tensor, i: int) -> torch.Tensor:
    """The clean sample the model predicts at step ``i`` of a flow-matching run:
    ``x0 = x_t − σ_t · v`` for ``x_t = (1 − σ)·x0 + σ·ε`` and ``v = ε − x0`` (rectified flow,
    arXiv 2403.03206), with σ_t from the scheduler's ``sigmas`` (offset by its ``begin_index``
    when an image-to-image run skips the first steps); same shape as ``latents``."""
    index = (getattr(scheduler, "begin_index", None) or 0) + i  # a run started late (strength) starts there
    sigma = scheduler.sigmas[index].to(latents.device, latents.dtype)
    return latents - sigma * noise_pred


class SequentialBranches:
    """A step's forwards made one after the other on this rank: the conditional prediction,
    then (``guided``) the guiding one (``parallel.cfg.CfgParallel`` makes them on two groups)."""

    def step(self, family, step: StepPlan, guided: bool, latents, t, cond, guide_cond, guidance, positions):
        """``(cond_pred, guide_pred or None)``, each shaped like ``latents``."""
        noise_pred = family.predict(latents, t, cond, guidance, positions, model=step.model, branch="cond")
        if not guided:
            return noise_pred, None
        return noise_pred, family.predict(latents, t, guide_cond, guidance, positions, model=step.guide,
                                          branch="uncond")


SCHEDULER_ROWS = ("model_outputs", "last_sample", "sample")  # diffusers' multistep history (UniPC, DPM-Solver)


def select_scheduler_rows(scheduler, rows: torch.Tensor) -> None:
    """Keep only sample ``rows`` in a scheduler's per-sample history (the previous model outputs
    a multistep scheduler such as Wan's UniPC combines with the next one), in place; Euler
    schedulers keep none."""
    for name in SCHEDULER_ROWS:
        value = getattr(scheduler, name, None)
        if isinstance(value, torch.Tensor):
            setattr(scheduler, name, value[rows])
        elif isinstance(value, list):
            setattr(scheduler, name, [x[rows] if isinstance(x, torch.Tensor) else x for x in value])


@torch.no_grad()
def denoise_batch(family, batch: list[SamplingParams], schedule: BatchSchedule | None = None, on_step=None,
                  on_guide_skipped=None, decode: bool = True, should_stop=None, encode=conditioning,
                  on_preview=None, prepare=initial_latents, branches=None, vae_decode=None,
                  rows_gone=None, dropped: dict[int, int] | None = None) -> LoopOutput:
    """Run a signature-homogeneous batch through ``family`` (a ``ModelFamily``) and decode it.

    ``schedule``: from :func:`plan_batch` (made here when None). ``on_step(i, num_steps)`` is
    called after each denoising step, ``on_guide_skipped(name)`` each time CFG gating skips a
    guiding forward of transformer ``name``. ``decode=False`` (sequence-parallel ranks other
    than 0) stops after denoising and returns no images. ``should_stop()`` is asked after each
    step; when it says so the loop raises :class:`BatchCancelled`. ``rows_gone()`` is asked
    after it: the batch indices of requests nobody waits for any more, whose sample rows are
    then dropped from the batch (latents, conditioning, positions, the scheduler's per-sample
    history) so the others finish alone, each as it would have (``LoopOutput.dropped``); every
    rank must get the same answer at the same step; ``dropped`` (a dict, filled as it happens:
    batch index -> steps done) lets a caller know them when the loop raises. ``encode``: how the
    prompts are encoded (:func:`conditioning`; a sequence-parallel runner passes one that
    encodes on rank 0 and broadcasts); ``prepare``: how the initial latents are made
    (:func:`initial_latents`; likewise). ``branches``: who makes a step's forwards
    (:class:`SequentialBranches`, the default: this rank makes both; a CFG-parallel runner
    passes ``parallel.cfg.CfgParallel``). ``vae_decode``: a decode every rank takes part in
    (``parallel.vae``: each decodes its tiles, the ranks with ``decode`` off too, and gets
    nothing back); None: only ``decode`` ranks decode. ``on_preview(request index, partial index, images)``
    receives the previews of requests with ``partial_images`` (float32 (n, H, W, 3) in [0, 1],
    ``family.decode_preview`` of the x0-prediction of that request's rows only — a video's first
    frame — with the regions the run keeps taken from the input image as after the last step
    (``family.after_step``), at :func:`preview_steps`;
    only where ``decode`` is on). Raises ``ValueError`` if the batch is
    empty or mixes signatures. A request whose own text fails to encode is left out (see
    ``LoopOutput.failures``); the others run exactly as they would without it.
    """
    head = check_homogeneous(batch)
    branches = branches or SequentialBranches()
    t0 = time.perf_counter()
    schedule = schedule or plan_batch(family, head)
    plan, scheduler, gate_at = schedule.plan, schedule.scheduler, schedule.gate_at
    keep, cond, uncond, failures = encode(family, batch, plan)
    if not keep:
        return LoopOutput([None] * len(batch), (time.perf_counter() - t0) * 1e3, 0.0, 0, failures=failures)
    kept = [batch[i] for i in keep]
    counts = [p.n for p in kept]
    latents, positions = prepare(family, kept, schedule)
    guidance = family.guidance(head.embedded_guidance_scale, latents.shape[0])

    num_steps = len(schedule.timesteps)
    splits = np.cumsum([0, *counts])
    previews: dict[int, list[tuple[int, int]]] = {}  # steps done -> (kept request position, partial index)
    if on_preview is not None and decode:
        for j, p in enumerate(kept):
            for k, step_count in enumerate(preview_steps(num_steps, p.partial_images)):
                previews.setdefault(step_count, []).append((j, k))
    delta, reused, calls = None, 0, {}
    dropped = {} if dropped is None else dropped
    for i, t in enumerate(schedule.timesteps):
        step = plan[i]
        guided = step.guide is not None and i < gate_at
        guide_cond = uncond if step.guide_prompt == "negative" else cond
        noise_pred, guide = branches.step(family, step, guided, latents, t, cond, guide_cond, guidance, positions)
        calls[step.model] = calls.get(step.model, 0) + 1
        if guided:
            calls[step.guide] = calls.get(step.guide, 0) + 1
            delta = noise_pred - guide
            noise_pred = family.combine_guidance(noise_pred, guide, step.scale)
        elif step.guide is not None:  # the guide the last delta implies: guide = cond - delta
            noise_pred = family.combine_guidance(noise_pred, noise_pred - delta, step.scale)
            reused += 1
            if on_guide_skipped is not None:
                on_guide_skipped(step.guide)
        if i + 1 in previews:
            # in the regions the run keeps (inpainting's unmasked area, image-to-video's first
            # frame) the x0-prediction is what the last step puts there: the input image
            x0 = family.after_step(x0_prediction(scheduler, latents, noise_pred, i), positions, num_steps - 1,
                                   scheduler, schedule.timesteps)
            for j, k in previews[i + 1]:
                rows = x0[splits[j]:splits[j + 1]]
                if torch.isfinite(rows).all():  # an overflowed request streams no black or white previews
                    on_preview(keep[j], k, family.decode_preview(rows, head))
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        latents = family.after_step(latents, positions, i, scheduler, schedule.timesteps)
        if on_step is not None:
            synchronize(latents.device)  # progress is steps the GPU has finished
            on_step(i + 1, num_steps)
        if should_stop is not None and should_stop() and i + 1 < num_steps:
            raise BatchCancelled(i + 1, num_steps, dropped)
        gone_ids = rows_gone() if rows_gone is not None else ()
        gone = [j for j, b in enumerate(keep) if b in gone_ids]
        if gone and i + 1 < num_steps:
            if len(gone) == len(keep):
                if not failures:  # nobody waits for anything this batch would answer
                    raise BatchCancelled(i + 1, num_steps, dropped)
                # the requests whose own text failed still get their 400s: end here, decoding nothing
                dropped.update({b: i + 1 for b in keep})
                return LoopOutput([None] * len(batch), (time.perf_counter() - t0) * 1e3, 0.0, num_steps, reused,
                                  calls, failures, dropped)
            stays = [j for j in range(len(keep)) if j not in gone]
            rows = torch.cat([torch.arange(splits[j], splits[j + 1]) for j in stays]).to(latents.device)
            latents, positions = latents[rows], family.select_positions(positions, rows)
            cond = cond.select(rows)
            uncond = None if uncond is None else uncond.select(rows)
            guidance = None if guidance is None else guidance[rows]
            delta = None if delta is None else delta[rows]
            select_scheduler_rows(scheduler, rows)
            dropped.update({keep[j]: i + 1 for j in gone})
            renumber = {old: new for new, old in enumerate(stays)}
            previews = {s: [(renumber[j], k) for j, k in v if j in renumber] for s, v in previews.items()}
            keep = [keep[j] for j in stays]
            splits = np.cumsum([0, *(batch[b].n for b in keep)])
    synchronize(latents.device)
    t1 = time.perf_counter()
    if not decode:
        if vae_decode is not None:
            family.decode(latents, head, vae_decode=vae_decode)  # this rank's tiles, gathered on rank 0
        return LoopOutput([], (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, num_steps, reused, calls,
                          failures or None, dropped or None)
    finite = torch.isfinite(latents.flatten(1)).all(dim=1).tolist()  # one bool per sample row
    non_finite = {b for b, a, z in zip(keep, splits[:-1], splits[1:], strict=True) if not all(finite[a:z])}
    images = family.decode(latents, head, vae_decode=vae_decode)  # host numpy arrays: the device has finished
    t2 = time.perf_counter()
    per_request: list[np.ndarray | None] = [None] * len(batch)
    for i, a, b in zip(keep, splits[:-1], splits[1:], strict=True):
        per_request[i] = images[a:b]
    return LoopOutput(
        images=per_request, denoise_ms=(t1 - t0) * 1e3, decode_ms=(t2 - t1) * 1e3, steps=num_steps,
        cfg_reused_steps=reused, calls=calls, failures=failures or None, dropped=dropped or None,
        non_finite=non_finite or None)
