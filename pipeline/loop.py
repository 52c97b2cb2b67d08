"""Our denoising loop: one batch of requests as one batched forward per step.

Per request: prompt, negative prompt and seed (one generator per request, drawing that
request's ``n`` samples). Shared by the batch (its signature): size, steps, guidance and
CFG mode. True CFG follows diffusers' ``FluxPipeline``: a separate unconditional forward
and ``uncond + true_cfg_scale · (cond − uncond)``.

CFG gating (``cfg_gate_step`` g < 1): after ``max(1, floor(g · steps))`` steps the
unconditional forward is skipped and the last computed delta (cond − uncond) is reused:
``cond + (true_cfg_scale − 1) · delta``. The idea follows CFG truncation / "CFG-Cache"
step skipping used by xDiT and vLLM-Omni; g = 1 runs every step exactly as without gating.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.sampling import SamplingParams


@dataclass
class LoopOutput:
    """images: one (n, H, W, 3) float32 array in [0, 1] per request, in batch order."""

    images: list[np.ndarray]
    denoise_ms: float
    decode_ms: float
    steps: int
    cfg_reused_steps: int = 0


def _check_homogeneous(batch: list[SamplingParams]) -> SamplingParams:
    from pipeline.signature import BatchSignature

    if not batch:
        raise ValueError("empty batch")
    first = BatchSignature.of(batch[0])
    for p in batch[1:]:
        if BatchSignature.of(p) != first:
            raise ValueError(f"batch mixes signatures: {first} vs {BatchSignature.of(p)}")
    return batch[0]


@torch.no_grad()
def denoise_batch(family, batch: list[SamplingParams], on_step=None, on_uncond_skipped=None,
                  decode: bool = True) -> LoopOutput:
    """Run a signature-homogeneous batch through ``family`` and decode it.

    ``on_step(i, num_steps)`` is called after each denoising step, ``on_uncond_skipped()``
    each time CFG gating skips an unconditional forward. ``decode=False`` (sequence-parallel
    ranks other than 0) stops after denoising and returns no images. Raises ``ValueError``
    if the batch is empty or mixes signatures.
    """
    head = _check_homogeneous(batch)
    t0 = time.perf_counter()
    counts = [p.n for p in batch]
    index = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(counts))

    cond = family.encode([p.prompt for p in batch]).select(index)
    uncond = family.encode([p.negative_prompt for p in batch]).select(index) if head.do_true_cfg else None

    generators = [torch.Generator(device="cpu").manual_seed(p.seed) for p in batch]
    latents, img_ids = family.prepare_latents(generators, counts, head.height, head.width)
    scheduler, timesteps = family.scheduler_and_timesteps(head.num_inference_steps, latents.shape[1])
    guidance = family.guidance(head.guidance_scale, latents.shape[0])

    num_steps = len(timesteps)
    gate_at = num_steps if head.cfg_gate_step >= 1.0 else max(1, math.floor(head.cfg_gate_step * num_steps))
    delta, reused = None, 0
    for i, t in enumerate(timesteps):
        noise_pred = family.predict(latents, t, cond, guidance, img_ids, branch="cond")
        if head.do_true_cfg and i < gate_at:
            neg = family.predict(latents, t, uncond, guidance, img_ids, branch="uncond")
            delta = noise_pred - neg
            noise_pred = neg + head.true_cfg_scale * delta
        elif head.do_true_cfg:
            noise_pred = noise_pred + (head.true_cfg_scale - 1.0) * delta
            reused += 1
            if on_uncond_skipped is not None:
                on_uncond_skipped()
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        if on_step is not None:
            on_step(i + 1, len(timesteps))
    t1 = time.perf_counter()
    if not decode:
        return LoopOutput([], (t1 - t0) * 1e3, 0.0, num_steps, reused)
    images = family.decode(latents, head.height, head.width)
    t2 = time.perf_counter()
    splits = np.cumsum([0, *counts])
    return LoopOutput(
        images=[images[a:b] for a, b in zip(splits[:-1], splits[1:])],
        denoise_ms=(t1 - t0) * 1e3, decode_ms=(t2 - t1) * 1e3, steps=num_steps, cfg_reused_steps=reused)
