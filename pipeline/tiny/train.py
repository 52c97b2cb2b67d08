"""Train the embedded tiny-flux on the procedural shapes dataset, on CPU, from a seed.

    python -m pipeline.tiny.train [--out DIR] [--vae-steps N] [--dit-steps N]

Stage 1 trains the tiny AutoencoderKL (reconstruction + a small KL term) and sets its
``shift_factor``/``scaling_factor`` from the latents' statistics, as FLUX's VAE config does.
Stage 2 trains the FLUX-architecture transformer with rectified flow / flow matching, as
FLUX is trained (Esser et al., "Scaling Rectified Flow Transformers", arXiv 2403.03206):
``x_t = (1 − σ)·x_0 + σ·ε`` with logit-normal σ, the model predicts ``ε − x_0``. Captions are
dropped 10 % of the time so true CFG has an unconditional branch. The text encoders (CLIP
and T5) are trained together with the transformer: FLUX gives text tokens no rotary position
(``txt_ids`` are zeros), so with frozen random encoders the transformer cannot tell the
shape's colour word from the background's; trained encoders learn to mark them. The saved
weights are an exponential moving average (decay 0.999) of the trained ones, as diffusion
models are usually sampled (``torch.optim.swa_utils`` EMA).
Deterministic for a given seed and thread count (the script pins 2 threads).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from compat import diffusers as compat
from pipeline.tiny.flux import TinyFluxArch, build_tiny_flux_pipeline
from pipeline.tiny.data import make_dataset, split_scenes



def _batches(n: int, batch: int, generator: torch.Generator):
    batch = min(batch, n)
    while True:
        for idx in torch.randperm(n, generator=generator).split(batch):
            if len(idx) == batch:
                yield idx


def train_vae(vae, images: torch.Tensor, steps: int, generator: torch.Generator, log) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=max(steps, 1), pct_start=0.1)
    vae.train()
    batches = _batches(len(images), 32, generator)
    for step in range(steps):
        x = images[next(batches)]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = vae.decode(z).sample
        loss = F.mse_loss(recon, x) + 1e-6 * posterior.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step:5d} loss {loss.item():.4f}")
    vae.eval()


@torch.no_grad()
def encode_latents(pipe, images: torch.Tensor) -> torch.Tensor:
    """Images (N, 3, 64, 64) in [-1, 1] → packed, normalised latents (N, S, 4·C); sets the
    VAE's shift/scaling factors from the data."""
    z = torch.cat([pipe.vae.encode(chunk).latent_dist.mean for chunk in images.split(256)])
    shift, scale = float(z.mean()), float(1.0 / z.std())
    pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    z = (z - shift) * scale
    n, c, h, w = z.shape
    return compat.flux_pack_latents(z, n, c, h, w)


def tokenize(pipe, captions: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids as ``FluxPipeline.encode_prompt`` makes them: CLIP (N, 77), T5 (N, L)."""
    clip = pipe.tokenizer(captions, padding="max_length", max_length=pipe.tokenizer.model_max_length,
                          truncation=True, return_tensors="pt").input_ids
    t5 = pipe.tokenizer_2(captions, padding="max_length", max_length=max_sequence_length, truncation=True,
                          return_tensors="pt").input_ids
    return clip, t5


def flow_matching_loss(transformer, x0: torch.Tensor, conditioning, text_ids: torch.Tensor, img_ids: torch.Tensor,
                       generator: torch.Generator) -> torch.Tensor:
    """The rectified-flow loss of one batch of packed latents ``x0`` (B, S, C): draws noise,
    a logit-normal σ and a guidance scale in [1, 5] from ``generator`` (in that order), then
    calls ``conditioning()`` for ``(pooled, prompt_embeds)`` and regresses ``ε − x_0``."""
    n = len(x0)
    eps = torch.randn(x0.shape, generator=generator)
    sigma = torch.sigmoid(torch.randn(n, generator=generator))
    s = sigma[:, None, None]
    xt = (1 - s) * x0 + s * eps
    guidance = 1.0 + 4.0 * torch.rand(n, generator=generator)
    pooled, embeds = conditioning()
    pred = transformer(hidden_states=xt, timestep=sigma, guidance=guidance, pooled_projections=pooled,
                       encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=img_ids, return_dict=False)[0]
    return F.mse_loss(pred, eps - x0)


def optimiser_step(loss: torch.Tensor, opt, sched, params) -> None:
    """Backward, clip the gradient norm to 1, step the optimiser and its schedule."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()


def train_transformer(pipe, latents, cond_index, clip_ids, t5_ids, text_ids, steps: int,
                      generator: torch.Generator, log, batch: int = 32, ema_decay: float = 0.999) -> None:
    """Flow matching on the transformer and both text encoders. ``clip_ids``/``t5_ids``: the
    captions' token ids, the last one the empty caption (the unconditional branch)."""
    transformer = pipe.transformer
    h = w = int(latents.shape[1] ** 0.5)
    img_ids = compat.flux_latent_image_ids(1, h, w, latents.device, latents.dtype)
    params = [*transformer.parameters(), *pipe.text_encoder.parameters(), *pipe.text_encoder_2.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=max(steps, 1), pct_start=0.05)
    modules = (transformer, pipe.text_encoder, pipe.text_encoder_2)
    for module in modules:
        module.train()
    averages = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(ema_decay)) for m in modules]
    batch = min(batch, len(latents))
    batches = _batches(len(latents), batch, generator)
    empty = len(t5_ids) - 1  # the last caption is "" (the unconditional branch)
    for step in range(steps):
        idx = next(batches)
        x0 = latents[idx]
        cap = cond_index[idx].clone()
        cap[torch.rand(batch, generator=generator) < 0.1] = empty
        loss = flow_matching_loss(transformer, x0, lambda: (
            pipe.text_encoder(clip_ids[cap], output_hidden_states=False).pooler_output,
            pipe.text_encoder_2(t5_ids[cap], output_hidden_states=False)[0]), text_ids, img_ids, generator)
        optimiser_step(loss, opt, sched, params)
        for module, average in zip(modules, averages):
            average.update_parameters(module)
        if step % 100 == 0 or step == steps - 1:
            log(f"dit step {step:5d} loss {loss.item():.4f}")
    for module, average in zip(modules, averages):
        module.load_state_dict(average.module.state_dict())
        module.eval()


# The trained tiny-flux's architecture: tiny-flux v2 with 16 T5 tokens (captions have at most
# 9 words) and whole-word CLIP tokens, so CLIP's pooled output (FLUX's global conditioning, which
# carries most of the colour) composes words rather than spelling them out character by character.
TRAINED_ARCH = TinyFluxArch(max_sequence_length=16, clip_word_tokens=True)


def train(out: Path, *, seed: int = 0, images: int = 4096, vae_steps: int = 500, dit_steps: int = 5500,
          threads: int = 2, log=print) -> Path:
    """Train and save a diffusers-format tiny-flux to ``out``; returns ``out``."""
    torch.set_num_threads(threads)
    t0 = time.time()
    pipe = build_tiny_flux_pipeline(dataclasses.replace(TRAINED_ARCH, seed=seed))
    train_scenes, _ = split_scenes(seed)
    pixels, scenes = make_dataset(train_scenes, images, seed)
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    generator = torch.Generator().manual_seed(seed)
    train_vae(pipe.vae, x, vae_steps, generator, log)
    latents = encode_latents(pipe, x)
    captions = sorted({s.caption for s in scenes})
    index = {c: i for i, c in enumerate(captions)}
    cond_index = torch.tensor([index[s.caption] for s in scenes])
    max_sequence_length = int(pipe.tokenizer_2.model_max_length)
    clip_ids, t5_ids = tokenize(pipe, captions + [""], max_sequence_length)
    text_ids = torch.zeros(max_sequence_length, 3)  # FluxPipeline's: no rotary position for text
    train_transformer(pipe, latents, cond_index, clip_ids, t5_ids, text_ids, dit_steps, generator, log)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    log(f"saved {out} after {time.time() - t0:.0f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--images", type=int, default=4096)
    ap.add_argument("--vae-steps", type=int, default=500)
    ap.add_argument("--dit-steps", type=int, default=5500)
    ns = ap.parse_args()
    train(ns.out, seed=ns.seed, images=ns.images, vae_steps=ns.vae_steps, dit_steps=ns.dit_steps)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
