"""BatchSignature: the key under which requests may share one batch.

Two requests share a batch only if every resolved setting that changes how the batch
executes is equal. The table below decides, field by field, what is in the key; a test
fails when SamplingParams gains a field that is not in the table.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

from pipeline.sampling import SamplingParams

# SamplingParams field -> is it part of the signature?
SIGNATURE_TABLE: dict[str, bool] = {
    "request_id": False,
    "model": True,
    "prompt": False,            # per-request conditioning inside one batched forward
    "negative_prompt": False,   # likewise (do_true_cfg below carries the CFG mode)
    "n": False,                 # counts toward the batch size instead
    "width": True,
    "height": True,
    "num_frames": True,
    "num_inference_steps": True,
    "guidance_scale": True,
    "true_cfg_scale": True,
    "do_true_cfg": True,
    "seed": False,              # one generator per request
    "enable_cache_dit": True,
    "cache_dit_params": True,
    "cfg_gate_step": True,
    "attention_backend": True,
    "response_format": False,
    "timeout_s": False,         # a deadline, not an execution setting
    "guidance_scale_2": True,
    "boundary_ratio": True,     # which expert runs which step
    "fps": False,               # only the MP4 container's frame rate
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
        return dict(zip(SIGNATURE_FIELDS, self.values))

    @property
    def digest(self) -> str:
        """12 hex digits, stable across processes (used in metadata and stats)."""
        return hashlib.sha1(repr(self.values).encode()).hexdigest()[:12]

    def __str__(self) -> str:
        d = self.as_dict()
        cache = "off" if not d["enable_cache_dit"] else f"on{dict(d['cache_dit_params'] or ())}"
        frames = f"x{d['num_frames']}f" if d["num_frames"] > 1 else ""
        experts = "" if d["boundary_ratio"] is None else f" boundary={d['boundary_ratio']}"
        experts += "" if d["guidance_scale_2"] is None else f" g2={d['guidance_scale_2']}"
        return (f"{d['model']} {d['width']}x{d['height']}{frames} steps={d['num_inference_steps']} "
                f"g={d['guidance_scale']} cfg={d['true_cfg_scale'] if d['do_true_cfg'] else 'off'} "
                f"cache_dit={cache} gate={d['cfg_gate_step']} attn={d['attention_backend'] or 'default'}"
                f"{experts} [{self.digest}]")


def _check_table() -> None:
    missing = {f.name for f in fields(SamplingParams)} ^ set(SIGNATURE_TABLE)
    if missing:
        raise RuntimeError(f"SIGNATURE_TABLE and SamplingParams disagree on {sorted(missing)}")


_check_table()
