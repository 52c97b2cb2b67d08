"""What the served model and the server configuration allow: the context requests are validated in."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.modes import DualMode, GuidanceMode

SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*x\s*(\d{1,6})\s*$")


@dataclass(frozen=True)
class ServingLimits:
    """The validation context of one deployment: the model's facts plus the ``limits`` config.

    ``spatial_factor``: width and height must be multiples of it (pixels; FLUX: VAE factor
    8 × patch 2 = 16). ``max_pixels``: width × height. Defaults fill fields a request omits.
    ``num_blocks``: transformer blocks cache-dit sees (0: unknown, not checked).
    ``attention_rejections``: kernel name -> why it cannot run here. ``world_size``: ranks
    the latent tokens of a sample are split across. ``guidance_style``: the guidance mode the
    model uses when guided. ``temporal_factor``: video models take ``k · temporal_factor + 1``
    frames (0: an image model).
    """

    model_name: str
    spatial_factor: int
    default_width: int
    default_height: int
    default_steps: int
    default_guidance_scale: float
    max_n: int = 4
    max_pixels: int = 1024 * 1024
    max_steps: int = 100
    max_prompt_chars: int = 2000
    guidance_embeds: bool = True
    num_blocks: int = 0
    attention_rejections: dict = field(default_factory=dict)
    world_size: int = 1
    guidance_style: GuidanceMode = GuidanceMode.TRUE_CFG
    dual_mode: DualMode = DualMode.SINGLE
    temporal_factor: int = 0
    default_num_frames: int = 1
    default_fps: int = 16
    max_frames: int = 1
    default_boundary_ratio: float | None = None


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` → ``(width, height)`` in pixels; raises ``ValueError`` if malformed."""
    match = SIZE_RE.match(size)
    if not match:
        raise ValueError(f"size must look like '1024x1024' (WIDTHxHEIGHT in pixels), got {size!r}")
    return int(match.group(1)), int(match.group(2))
