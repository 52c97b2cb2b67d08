"""The string states of the execution core, as enums (torch-free).

Each is a ``str`` enum, so it compares equal to, serialises as and prints as its value
(``GuidanceMode.CFG == "cfg"``; ``f"{mode}"`` is ``"cfg"``).
"""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """A ``str`` enum that prints as its value on every Python version ditserve supports."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class GuidanceMode(StrEnum):
    """How a batch makes its guiding prediction (the second forward of a step).

    ``NONE``: no guiding forward. ``TRUE_CFG``: FLUX's true CFG on the negative prompt
    (``FluxPipeline``: ``true_cfg_scale > 1`` and a negative prompt). ``CFG``: classifier-free
    guidance on the negative prompt, default ``""`` (``WanPipeline``: ``guidance_scale > 1``).
    ``AUTOGUIDANCE``: a second transformer guides from the prompt itself (paired models; Karras
    et al. 2024, arXiv:2406.02507). A model family declares which of the last three it uses.
    """

    NONE = "none"
    TRUE_CFG = "true_cfg"
    CFG = "cfg"
    AUTOGUIDANCE = "autoguidance"


class DualMode(StrEnum):
    """How a model with two transformers uses the second one.

    ``SINGLE``: one transformer. ``BOUNDARY``: ``transformer`` runs the high-noise steps and
    ``transformer_2`` the rest (Wan 2.2 A14B, diffusers' ``boundary_ratio``). ``PAIRED``: both
    run at every step, the second making the guiding prediction.
    """

    SINGLE = "single"
    BOUNDARY = "boundary"
    PAIRED = "paired"


class Priority(StrEnum):
    """The order the Router serves queued work in (``deployments.scheduling``).

    ``INTERACTIVE`` (the default): someone waits for it. ``BATCH``: served after interactive
    work, until it has waited ``batching.max_batch_priority_wait_ms`` (its starvation bound).
    """

    INTERACTIVE = "interactive"
    BATCH = "batch"


class InputMode(StrEnum):
    """What a request starts from, besides its prompt (in the batch signature).

    ``TEXT``: noise only. ``IMAGE_TO_IMAGE``: an input image noised to ``strength``'s timestep
    (``FluxImg2ImgPipeline``). ``INPAINT``: an image and a mask; the unmasked region is blended
    back at each step (``FluxInpaintPipeline``). ``REFERENCE``: the image's latent tokens join
    the sequence with their own position ids (FLUX.1 Kontext, ``FluxKontextPipeline``).
    ``IMAGE_TO_VIDEO``: the image conditions a video's first latent frame (Wan 2.2 latent
    conditioning, ``WanImageToVideoPipeline`` with ``expand_timesteps``).
    """

    TEXT = "text"
    IMAGE_TO_IMAGE = "image_to_image"
    INPAINT = "inpaint"
    REFERENCE = "reference"
    IMAGE_TO_VIDEO = "image_to_video"


class OffloadMode(StrEnum):
    """``model.offload`` (``pipeline.offload``'s docstring)."""

    NONE = "none"
    IDLE_EXPERT = "idle_expert"
    GROUP = "group"


OFFLOAD_MODES = tuple(mode.value for mode in OffloadMode)


def offload_problems(mode: str, *, boundary_experts: bool, torch_compile: bool) -> list[str]:
    """Why ``model.offload=mode`` cannot serve this model (empty: it can), naming the fields."""
    problems = []
    if mode not in OFFLOAD_MODES:
        problems.append(f"model.offload must be one of {', '.join(OFFLOAD_MODES)}, got {mode!r}")
    elif mode == OffloadMode.IDLE_EXPERT and not boundary_experts:
        problems.append("model.offload='idle_expert' needs a model with boundary experts (two transformers, one "
                        "running at a time: Wan 2.2 A14B with model.dual_transformer 'boundary')")
    if mode != OffloadMode.NONE and torch_compile:
        problems.append(f"model.offload={mode!r} moves weights between steps, which acceleration.torch_compile "
                        "would have traced as fixed: use one or the other")
    return problems
