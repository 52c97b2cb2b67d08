"""BatchSignature: the key under which requests may share one batch (torch-free).

Two requests share a batch only if every resolved setting that changes how the batch
executes is equal. The table below decides, field by field, what is in the key; a test
fails when SamplingParams gains a field that is not in the table.
"""

from __future__ import annotations

import hashlib
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
    "partial_images": False,    # previews decode this request's rows at a few steps; the batch runs the same
    "input_mode": True,         # text, image-to-image, inpainting, reference, image-to-video: what each step runs
    "strength": True,           # which timesteps run (and so Cache-DiT's step count)
    "num_input_images": True,   # reference tokens in the sequence
    "images": False,            # per request, like the prompt
    "mask": False,              # per request; whether there is one is the input_mode
}
SIGNATURE_FIELDS = tuple(name for name, inside in SIGNATURE_TABLE.items() if inside)


@dataclass(frozen=True)
class BatchSignature:
    """Frozen, hashable key: the values of ``SIGNATURE_FIELDS`` in table order."""

    values: tuple

    @classmethod
    def of(cls, params: SamplingParams) -> "BatchSignature":
        return cls(tuple(getattr(params, name) for name in SIGNATURE_FIELDS))

    def as_dict(self) -> dict:
        return dict(zip(SIGNATURE_FIELDS, self.values, strict=True))

    @property
    def digest(self) -> str:
        """12 hex digits, stable across processes (used in metadata and stats)."""
        return hashlib.sha1(repr(self.values).encode()).hexdigest()[:12]

    def __str__(self) -> str:
        """The signature in the request fields' own names, e.g. ``tiny-flux 64x64 steps=16
        guidance_scale=3.5 cache_dit=off cfg_gate_step=1.0 attn=default [digest]`` (with
        ``true_cfg_scale=4.0`` after the guidance where true CFG runs)."""
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
        cache = "off" if not d["enable_cache_dit"] else f"on{d['cache_dit_params'].describe()}"
        lora = "".join(f" lora={s.name}:{s.scale:g}" for s in d["lora"])
        if d["input_mode"] != InputMode.TEXT:
            strength = "" if d["strength"] is None else f" strength={d['strength']:g}"
            lora += f" {d['input_mode']}{strength}"
        return (f"{d['model']}{lora} {d['width']}x{d['height']}{frames} steps={d['num_inference_steps']} "
                f"{' '.join(guidance)} cache_dit={cache} cfg_gate_step={d['cfg_gate_fraction']} "
                f"attn={d['attention_backend'] or 'default'} [{self.digest}]")


def _check_table() -> None:
    missing = {f.name for f in fields(SamplingParams)} ^ set(SIGNATURE_TABLE)
    if missing:
        raise RuntimeError(f"SIGNATURE_TABLE and SamplingParams disagree on {sorted(missing)}")


_check_table()
