"""BatchSignature: the key under which requests may share one batch (torch-free).

Two requests share a batch only if every resolved setting that changes how the batch
executes is equal. The table below decides, field by field, what is in the key; a test
fails when SamplingParams gains a field that is not in the table. A field whose different
values can run the same is keyed by what it makes the batch run (``SIGNATURE_KEYS``), so
such requests share a batch; Cache-DiT knobs equal to cache-dit's defaults are dropped
before (``CacheDiTParams.canonical``, at resolve: ``pipeline.sampling.check_cache_dit``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, fields

from pipeline.modes import GuidanceMode, InputMode
from pipeline.sampling import SamplingParams

# SamplingParams field -> is it part of the signature?
SIGNATURE_TABLE: dict[str, bool] = {
    "request_id": False,
    "model": True,
    "prompt": False,            # per-request conditioning inside one batched forward
    "negative_prompt": False,   # likewise (guidance_mode below carries whether it is used)
    "n": False,                 # counts toward the batch size instead
    "width": True,
    "height": True,
    "num_frames": True,
    "num_inference_steps": True,
    "guidance_mode": True,
    "cfg_scale": True,
    "embedded_guidance_scale": True,
    "seed": False,              # one generator per request
    "enable_cache_dit": True,
    "cache_dit_params": True,
    "cfg_gate_fraction": True,
    "attention_backend": True,
    "response_format": False,
    "output_format": False,     # encoding, per request, after the batch has run
    "output_compression": False,
    "timeout_s": False,         # a deadline, not an execution setting
    "priority": False,          # the order queues are served in, not how a batch runs
    "cfg_scale_2": True,
    "boundary_ratio": True,     # which expert runs which step
    "fps": False,               # only the MP4 container's frame rate
    "lora": True,               # the adapter set (names, scales, files): replica state
    "model_adapter": False,     # which field named an adapter (errors name it): the set is `lora`
    "partial_images": False,    # previews decode this request's rows at a few steps; the batch runs the same
    "input_mode": True,         # text, image-to-image, inpainting, reference, image-to-video: what each step runs
    "strength": True,           # which timesteps run (and so Cache-DiT's step count)
    "num_input_images": True,   # reference tokens in the sequence
    "images": False,            # per request, like the prompt
    "mask": False,              # per request; whether there is one is the input_mode
}
SIGNATURE_FIELDS = tuple(name for name, inside in SIGNATURE_TABLE.items() if inside)

# Signature fields keyed by what they make the batch run instead of their value
SIGNATURE_KEYS: dict[str, Callable[[SamplingParams], object]] = {
    # the step gating starts at (None: no gating): 0.1 and 0.2 of 6 steps, or any fraction of an
    # unguided request, run alike
    "cfg_gate_fraction": lambda p: p.cfg_gate,
    # the steps that run (diffusers' int(N − N·strength) skipped): 0.55 and 0.6 of 8 steps both run 5
    "strength": lambda p: None if p.strength is None else p.effective_steps,
    # the low-noise expert's guidance scale: none without a guiding forward, the high-noise
    # expert's when equal (as when unset)
    "cfg_scale_2": lambda p: p.cfg_scale_2 if p.guided and p.cfg_scale_2 != p.cfg_scale else None,
}


@dataclass(frozen=True)
class BatchSignature:
    """Frozen, hashable key: the values of ``SIGNATURE_FIELDS`` in table order."""

    values: tuple

    @classmethod
    def of(cls, params: SamplingParams) -> "BatchSignature":
        return cls(tuple(SIGNATURE_KEYS[name](params) if name in SIGNATURE_KEYS else getattr(params, name)
                         for name in SIGNATURE_FIELDS))

    def as_dict(self) -> dict:
        return dict(zip(SIGNATURE_FIELDS, self.values, strict=True))

    @property
    def digest(self) -> str:
        """12 hex digits, stable across processes (used in metadata and stats)."""
        return hashlib.sha1(repr(self.values).encode()).hexdigest()[:12]

    def __str__(self) -> str:
        """The signature in the request fields' own names, e.g. ``tiny-flux 64x64 steps=16
        guidance_scale=3.5 cache_dit=off cfg_gate_step=off attn=default [digest]`` (with
        ``true_cfg_scale=4.0`` after the guidance where true CFG runs). A gate and an edit's
        strength read as the steps they give of those that run: ``cfg_gate_step=3/6`` (the
        guiding forward runs 3 of 6 steps), ``image_to_image strength=5/8`` (5 of 8 steps run)."""
        d = self.as_dict()
        frames = f"x{d['num_frames']}f" if d["num_frames"] > 1 else ""
        guidance = [] if d["embedded_guidance_scale"] is None else [f"guidance_scale={d['embedded_guidance_scale']}"]
        mode = d["guidance_mode"]
        if mode == GuidanceMode.TRUE_CFG:
            guidance.append(f"true_cfg_scale={d['cfg_scale']}")
        elif mode == GuidanceMode.CFG:
            guidance.append(f"guidance_scale={d['cfg_scale']}")
        elif mode == GuidanceMode.AUTOGUIDANCE:
            guidance.append(f"guidance_scale={d['cfg_scale']} (autoguidance)")
        elif not guidance:
            guidance.append("cfg=off")
        if d["cfg_scale_2"] is not None:
            guidance.append(f"guidance_scale_2={d['cfg_scale_2']}")
        if d["boundary_ratio"] is not None:
            guidance.append(f"boundary_ratio={d['boundary_ratio']}")
        runs = d["num_inference_steps"] if d["strength"] is None else d["strength"]
        cache = "off" if not d["enable_cache_dit"] else f"on{d['cache_dit_params'].describe()}"
        lora = "".join(f" lora={s.name}:{s.scale:g}" for s in d["lora"])
        if d["input_mode"] != InputMode.TEXT:
            strength = "" if d["strength"] is None else f" strength={d['strength']}/{d['num_inference_steps']}"
            lora += f" {d['input_mode']}{strength}"
        gate = "off" if d["cfg_gate_fraction"] is None else f"{d['cfg_gate_fraction']}/{runs}"
        return (f"{d['model']}{lora} {d['width']}x{d['height']}{frames} steps={d['num_inference_steps']} "
                f"{' '.join(guidance)} cache_dit={cache} cfg_gate_step={gate} "
                f"attn={d['attention_backend'] or 'default'} [{self.digest}]")


def _check_table() -> None:
    missing = {f.name for f in fields(SamplingParams)} ^ set(SIGNATURE_TABLE)
    if missing:
        raise RuntimeError(f"SIGNATURE_TABLE and SamplingParams disagree on {sorted(missing)}")


_check_table()
