"""What the served model and the server configuration allow: the context requests are validated in."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.contract.text import shown
from pipeline.modes import DualMode, GuidanceMode, InputMode

SIZE_RE = re.compile(r"^([0-9]{1,9})x([0-9]{1,9})$")  # ASCII digits only, no spaces; a side past 9 digits is no size
# Guidance scales above this only saturate the image; the bound keeps every scale far inside float32.
MAX_GUIDANCE_SCALE = 100.0
# limits.max_input_pixels when the config gives none: max_pixels x 16, up to 4096 x 4096 (a phone
# photo, 12 MP, and more), never below max_pixels; a larger upload is refused before it is decoded
DEFAULT_MAX_INPUT_PIXELS = 4096 * 4096


def default_max_input_pixels(max_pixels: int) -> int:
    """``limits.max_input_pixels`` when the config gives none: ``16 · max_pixels``, at most
    ``DEFAULT_MAX_INPUT_PIXELS``, at least ``max_pixels`` (pixels). It was ``max_pixels``, which
    refused a 12 MP photo where ``max_pixels`` is 2 MP, though an edit scales it down
    (helper-63); 16 MP everywhere cost a 64x64 CPU model's Ingress 68 MB per decode
    (helper-65), so the bound follows the model's scale."""
    return max(max_pixels, min(DEFAULT_MAX_INPUT_PIXELS, 16 * max_pixels))


@dataclass(frozen=True)
class ServingLimits:
    """The validation context of one deployment: the model's facts plus the ``limits`` config.

    ``spatial_factor``: width and height must be multiples of it (pixels; FLUX: VAE factor
    8 × patch 2 = 16). ``max_pixels``: width × height. Defaults fill fields a request omits.
    ``num_blocks``: transformer blocks cache-dit sees (0: unknown, not checked); an
    ``Fn_compute_blocks + Bn_compute_blocks`` past it is refused (cache-dit asserts), as is one
    reaching ``longest_block_list`` (0: ``num_blocks``), which would leave no block to cache.
    ``attention_rejections``: kernel name -> why it cannot run here. ``world_size``: ranks
    the latent tokens of a sample are split across. ``guidance_style``: the guidance mode the
    model uses when guided. ``temporal_factor``: video models take ``k · temporal_factor + 1``
    frames (0: an image model). ``special_tokens``: strings the model's tokenizers treat as
    special (refused in prompts). ``scm_preset_steps``: per cache-dit SCM preset, the step
    counts (up to ``max_steps``) cache-dit's own mask builder accepts (empty: not checked).
    ``max_timeout_s``: the longest ``timeout_s`` a request may ask for (seconds).
    ``default_image_priority`` / ``default_video_priority``: the ``priority`` of a request
    that gives none, per route (``interactive`` or ``batch``). ``loras``: the registered LoRA
    adapters by name (``pipeline.contract.lora.LoraEntry``); ``max_loras``: the most a request
    may name. ``input_modes``: what the model serves beyond text (``InputMode``);
    ``max_input_images``: images one request may give; ``default_strength``: image-to-image's
    ``strength`` when a request gives none (inpainting's is 1.0: the masked region is repainted).
    ``max_input_pixels``: the most pixels an uploaded image may declare (checked before decoding).
    ``cfg_threshold``: a CFG-style model guides when ``guidance_scale`` exceeds it (the family's
    pipeline rule: ``WanPipeline`` 1, ``ZImagePipeline`` 0). ``min_steps``: the fewest
    ``num_inference_steps`` the model runs correctly. ``true_cfg_default``: the ``true_cfg_scale``
    of a request with a negative prompt and no scale (the pipeline's default). ``cfg_degree``: the
    replica's CFG parallelism (2: a guided step's branches run on two groups of ranks).
    ``sequence_multiple``: the model pads a sample's split sequence to a multiple of it (1: the
    latent tokens themselves must split evenly across ``world_size``). ``requires_image``: the
    model only edits images (text-to-image requests are refused). ``max_side`` (pixels),
    ``max_latent_frames``, ``max_aspect_ratio`` (long side / short): what the model's position
    tables and encoders take (0: any).
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
    longest_block_list: int = 0
    attention_rejections: dict = field(default_factory=dict)
    world_size: int = 1
    guidance_style: GuidanceMode = GuidanceMode.TRUE_CFG
    dual_mode: DualMode = DualMode.SINGLE
    temporal_factor: int = 0
    default_num_frames: int = 1
    default_fps: int = 16
    max_frames: int = 1
    default_boundary_ratio: float | None = None
    special_tokens: tuple[str, ...] = ()
    scm_preset_steps: dict = field(default_factory=dict)
    max_timeout_s: float = 3600.0
    default_image_priority: str = "interactive"
    default_video_priority: str = "interactive"
    loras: dict = field(default_factory=dict)
    max_loras: int = 4
    input_modes: tuple[InputMode, ...] = ()
    max_input_images: int = 1
    default_strength: float = 0.6
    max_input_pixels: int = 1024 * 1024
    cfg_threshold: float = 1.0
    min_steps: int = 1
    true_cfg_default: float = 1.0
    cfg_degree: int = 1
    sequence_multiple: int = 1
    requires_image: bool = False
    max_side: int = 0
    max_latent_frames: int = 0
    max_aspect_ratio: float = 0.0


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` → ``(width, height)`` in pixels; raises ``ValueError`` if malformed."""
    match = SIZE_RE.match(size)
    if not match:
        raise ValueError(f"size must look like '1024x1024' (WIDTHxHEIGHT in pixels, ASCII digits), got {shown(size)}")
    return int(match.group(1)), int(match.group(2))


def size_problem(width: int, height: int, limits: ServingLimits) -> str | None:
    """Why an output of ``width`` × ``height`` pixels cannot run on this model (None: it can):
    both sides positive multiples of ``spatial_factor``, at most ``max_pixels``, each side at
    most ``max_side`` (the model's position table) and at most ``max_aspect_ratio`` : 1."""
    f = limits.spatial_factor
    if width < f or height < f or width % f or height % f:
        return f"size {width}x{height}: width and height must be positive multiples of {f} pixels"
    if width * height > limits.max_pixels:
        return f"size {width}x{height} has {width * height} pixels; at most {limits.max_pixels} are allowed"
    if limits.max_side and max(width, height) > limits.max_side:
        return (f"size {width}x{height}: each side must be at most {limits.max_side} pixels on this model "
                "(its position table)")
    ratio = max(width, height) / min(width, height)
    if limits.max_aspect_ratio and ratio > limits.max_aspect_ratio:
        return (f"size {width}x{height} is {ratio:.4g}:1; this model takes at most {limits.max_aspect_ratio:g}:1 "
                "(long side to short)")
    return None


# The longest side, in pixels, each lossy image encoder writes: libjpeg's JPEG_MAX_DIMENSION and
# libwebp's WEBP_MAX_DIMENSION. Pillow raises past them, after the whole generation has run.
# PNG's (2^31 - 1) is past any size a model serves.
ENCODER_MAX_SIDE = {"jpeg": 65500, "webp": 16383}
VIDEO_IMAGE_FORMAT = "webp"  # a video's thumbnail and previews (OpenAI's content variant "thumbnail")


def encoding_problem(width: int, height: int, output_format: str | None) -> str | None:
    """Why an image of ``width`` × ``height`` pixels cannot be written as ``output_format``
    (``png``, ``jpeg``, ``webp``; None: a video, whose thumbnail and previews are
    ``VIDEO_IMAGE_FORMAT``); None when it can. Each side at most ``ENCODER_MAX_SIDE``."""
    limit = ENCODER_MAX_SIDE.get(output_format or VIDEO_IMAGE_FORMAT)
    if not limit or max(width, height) <= limit:
        return None
    if output_format is None:
        return (f"size {width}x{height}: a video's thumbnail and previews are {VIDEO_IMAGE_FORMAT}, which takes at "
                f"most {limit} pixels a side")
    return (f"size {width}x{height}: output_format {output_format} takes at most {limit} pixels a side (its "
            "encoder's limit); ask a smaller size or output_format png")


def split_problem(width: int, height: int, limits: ServingLimits, latent_frames: int = 1,
                  frames_field: str | None = None) -> str | None:
    """Why a sample of ``width`` × ``height`` pixels (and ``latent_frames`` latent frames, a
    video's) cannot be split across the replica's sequence-parallel ranks (None: it can),
    naming the numbers and the rule: ``(width/f)·(height/f)·latent_frames`` latent tokens
    (``f``: ``spatial_factor``) must be a multiple of ``world_size``. ``frames_field``: the
    request field that set the frames (``num_frames`` / ``seconds``), named beside ``size``; None:
    the request gave neither, the frames are ``limits.default_num_frames`` (helper-80: such a
    request was told its ``seconds`` gave them)."""
    f = limits.spatial_factor
    tokens = latent_frames * (width // f) * (height // f)
    if splits_evenly(tokens, limits):
        return None
    world = limits.world_size
    per_frame = f"({width}/{f})·({height}/{f})"
    if latent_frames > 1:
        source = frames_field or f"the default num_frames ({limits.default_num_frames}, limits.default_num_frames)"
        return (f"size {width}x{height} with {source} giving {latent_frames} latent frames is "
                f"{per_frame}·{latent_frames} = {tokens} latent tokens, which cannot be split evenly across the "
                f"replica's {world} sequence-parallel ranks; allowed: a size and frame count whose latent tokens "
                f"(width/{f})·(height/{f})·latent frames are a multiple of {world}")
    tokens_said = "1 latent token" if tokens == 1 else f"{tokens} latent tokens"
    return (f"size {width}x{height} is {per_frame} = {tokens_said}, which cannot be split evenly across the "
            f"replica's {world} sequence-parallel ranks; allowed: sizes whose (width/{f})·(height/{f}) is a "
            f"multiple of {world}")


def splits_evenly(tokens: int, limits: ServingLimits) -> bool:
    """Whether a sample of ``tokens`` latent tokens splits across the replica's sequence-parallel
    ranks: evenly, or any size when the model pads its sequence to a multiple they divide."""
    world = limits.world_size
    return world <= 1 or tokens % world == 0 or limits.sequence_multiple % world == 0
