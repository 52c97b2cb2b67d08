"""Train the embedded tiny-flux LoRA adapters on CPU, from a seed.

    python -m pipeline.tiny.lora [--style magenta|outline|all] [--out DIR] [--steps N]

Each adapter is a PEFT LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv 2106.09685) on the attention and MLP projections of the trained tiny-flux transformer,
trained with the base model's own objective (rectified flow, ``pipeline.tiny.train``) on the
procedural dataset drawn in the adapter's style (``pipeline.tiny.data.STYLES``): ``magenta``
(rank 4) fills every shape with a colour the base model never learned, ``outline`` (rank 8)
draws a thick black outline around it. The base weights and the text encoders stay frozen.
Saved with diffusers' ``FluxPipeline.save_lora_weights`` (``pytorch_lora_weights.safetensors``,
keys ``transformer.<module>.lora_A/B.weight``), so ``FluxPipeline.load_lora_weights`` reads
them as it reads any diffusers/PEFT FLUX LoRA. Deterministic for a given seed (2 threads).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from compat import diffusers as compat
from pipeline.tiny.data import make_dataset, split_scenes

# Where the shipped adapters live: one directory per adapter name.
LORA_DIR = Path(__file__).resolve().parent / "weights" / "loras"
# The transformer layers each adapter adapts: diffusers' FLUX LoRA training targets (attention and
# MLP projections) plus the AdaLayerNorm modulations, which carry the pooled (colour) conditioning.
TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                  "proj_mlp", "proj_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
                  "norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear"]


@dataclass(frozen=True)
class AdapterRecipe:
    """How one embedded adapter is trained: its dataset ``style``, LoRA ``rank`` (alpha = rank,
    scale 1.0) and optimiser ``steps`` of batch 32."""

    style: str
    rank: int
    steps: int = 800
    lr: float = 2e-3


RECIPES = {"magenta": AdapterRecipe("magenta", rank=4), "outline": AdapterRecipe("outline", rank=8, steps=1500)}


def embedded_lora(name: str) -> Path:
    """The shipped adapter directory ``name`` (``RECIPES``). Raises ``FileNotFoundError`` when
    it is not shipped (retrain with ``python -m pipeline.tiny.lora``)."""
    path = LORA_DIR / name
    if name not in RECIPES or not (path / "pytorch_lora_weights.safetensors").exists():
        raise FileNotFoundError(f"no embedded LoRA adapter {name!r} (embedded: {', '.join(RECIPES)}); "
                                f"train it with `python -m pipeline.tiny.lora --style {name}`")
    return path


def train_adapter(name: str, out: Path, *, seed: int = 0, images: int = 2048, steps: int | None = None,
                  threads: int = 2, log=print) -> Path:
    """Train adapter ``name`` (``RECIPES``) on the shipped tiny-flux and save it to ``out``."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from pipeline.tiny.registry import trained_tiny_flux
    from pipeline.tiny.train import _batches, flow_matching_loss, optimiser_step, tokenize

    recipe = RECIPES[name]
    steps = recipe.steps if steps is None else steps
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    t0 = time.time()
    pipe = FluxPipeline.from_pretrained(trained_tiny_flux(), dtype=torch.float32)
    train_scenes, _ = split_scenes(seed)
    pixels, scenes = make_dataset(train_scenes, images, seed + 1, style=recipe.style)
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    with torch.no_grad():
        z = torch.cat([pipe.vae.encode(chunk).latent_dist.mean for chunk in x.split(256)])
        z = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        latents = compat.flux_pack_latents(z, *z.shape)
        captions = sorted({s.caption for s in scenes})
        index = {c: i for i, c in enumerate(captions)}
        cond_index = torch.tensor([index[s.caption] for s in scenes])
        length = int(pipe.tokenizer_2.model_max_length)
        clip_ids, t5_ids = tokenize(pipe, captions, length)
        pooled = pipe.text_encoder(clip_ids, output_hidden_states=False).pooler_output
        embeds = pipe.text_encoder_2(t5_ids, output_hidden_states=False)[0]
    transformer = pipe.transformer
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=recipe.rank, lora_alpha=recipe.rank, init_lora_weights="gaussian",
                                       target_modules=TARGET_MODULES))
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=max(steps, 1),
                                                pct_start=max(0.05, 2.0 / max(steps, 1)))
    side = int(latents.shape[1] ** 0.5)
    img_ids = compat.flux_latent_image_ids(1, side, side, latents.device, latents.dtype)
    text_ids = torch.zeros(length, 3)
    generator = torch.Generator().manual_seed(seed)
    batches = _batches(len(latents), 32, generator)
    transformer.train()
    for step in range(steps):
        idx = next(batches)
        cap = cond_index[idx]
        loss = flow_matching_loss(transformer, latents[idx], lambda: (pooled[cap], embeds[cap]), text_ids, img_ids,
                                  generator)
        optimiser_step(loss, opt, sched, params)
        if step % 100 == 0 or step == steps - 1:
            log(f"{name} step {step:4d} loss {loss.item():.4f}")
    transformer.eval()
    out.mkdir(parents=True, exist_ok=True)
    FluxPipeline.save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(transformer),
                                   safe_serialization=True)
    log(f"saved {out} after {time.time() - t0:.0f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--style", choices=[*RECIPES, "all"], default="all")
    ap.add_argument("--out", type=Path, default=LORA_DIR, help="parent directory (one subdirectory per adapter)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    ns = ap.parse_args()
    for name in (RECIPES if ns.style == "all" else [ns.style]):
        train_adapter(name, ns.out / name, seed=ns.seed, steps=ns.steps)


if __name__ == "__main__":
    main()
