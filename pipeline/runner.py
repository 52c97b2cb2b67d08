"""The replica-side batch runner: loads a checkpoint and turns a Batch into per-request outputs.

It owns the model and (later) the acceleration state of one rank; it never decides what
runs next. PNG encoding happens here so no tensor ever reaches the router.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from pipeline.families import detect_family, load_family
from pipeline.loop import denoise_batch
from pipeline.sampling import SamplingParams
from pipeline.signature import BatchSignature
from pipeline.tiny.build import TINY_FLUX, ensure_tiny_flux


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
    """One request's answer from a replica: PNG bytes of its ``n`` images and metadata parts."""

    request_id: str
    seed: int
    pngs: list[bytes]
    timings_ms: dict[str, float]
    acceleration: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)  # batch_id, batch_size, signature, replica, ...


@dataclass(frozen=True)
class ModelFacts:
    """What the ingress needs to validate requests without loading the model."""

    family: str
    spatial_factor: int
    guidance_embeds: bool


def resolve_checkpoint(name: str, path: str | None) -> Path | str:
    """The checkpoint to load: ``path`` if given, else the embedded ``tiny-flux`` (built on
    first use). Raises ``FileNotFoundError`` for a ``path`` that is neither a local
    diffusers directory nor (where the machine is online) a hub id."""
    if path is None:
        if name != TINY_FLUX:
            raise FileNotFoundError(f"model {name!r} needs a checkpoint path (only {TINY_FLUX!r} is embedded)")
        return ensure_tiny_flux()
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "model_index.json").exists():
            raise FileNotFoundError(f"{local} is not a diffusers checkpoint (no model_index.json)")
        return local
    return path


def encode_png(image) -> bytes:
    """(H, W, 3) float32 in [0, 1] → PNG bytes (rounded to uint8 as diffusers' numpy_to_pil)."""
    array = (image * 255).round().clip(0, 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BatchRunner:
    """Loads one checkpoint and runs signature-homogeneous batches on it, one at a time."""

    def __init__(self, name: str, path: str | None = None, family: str | None = None,
                 dtype: str = "float32", device: str = "cpu"):
        checkpoint = resolve_checkpoint(name, path)
        self.name = name
        self.family_name = family or detect_family(checkpoint)
        self.family = load_family(self.family_name, checkpoint, torch_dtype=DTYPES[dtype], device=device)

    def facts(self) -> ModelFacts:
        return ModelFacts(self.family_name, self.family.spatial_factor, self.family.guidance_embeds)

    def run(self, batch: Batch, on_step=None) -> list[RequestOutput]:
        """Denoise and decode ``batch``; one RequestOutput per request, in batch order.

        Raises whatever the model raises; the caller answers every request of the batch.
        """
        out = denoise_batch(self.family, list(batch.requests), on_step=on_step)
        t0 = time.perf_counter()
        pngs = [[encode_png(img) for img in images] for images in out.images]
        encode_ms = (time.perf_counter() - t0) * 1e3
        head = batch.requests[0]
        acceleration = {
            "cache_dit": {"active": False, "transition": "none", "cached_steps": 0, "computed_steps": out.steps},
            "attention_backend": head.attention_backend or "default",
            "cfg_gate": {"gate_step": head.cfg_gate_step, "reused_steps": 0},
        }
        return [
            RequestOutput(p.request_id, p.seed, png_list,
                          {"denoise": out.denoise_ms, "decode": out.decode_ms + encode_ms}, acceleration)
            for p, png_list in zip(batch.requests, pngs)
        ]
