"""The embedded checkpoints by served model name, and how a configured model name resolves.

``tiny-flux`` is trained and shipped in ``pipeline/tiny/weights`` (``python -m
pipeline.tiny.train``); the others are random-weight models built on first use into
``$DITSERVE_CACHE_DIR``. Each entry names its model family, so the family conformance test
covers every registered family through its tiny models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.tiny.flux import TINY_FLUX, ensure_tiny_flux, ensure_tiny_flux_kontext
from pipeline.tiny.flux2 import TINY_FLUX2, ensure_tiny_flux2
from pipeline.tiny.qwen_image import (TINY_QWEN_IMAGE, TINY_QWEN_IMAGE_EDIT, ensure_tiny_qwen_image,
                                      ensure_tiny_qwen_image_edit)
from pipeline.tiny.z_image import TINY_Z_IMAGE, ensure_tiny_z_image
from pipeline.tiny.wan import TinyWanArch, ensure_tiny_wan

TINY_FLUX_RANDOM = "tiny-flux-random"
# The trained default, shipped with the package (about 5 MB, float32).
TRAINED_TINY_FLUX = Path(__file__).resolve().parent / "weights" / TINY_FLUX


def trained_tiny_flux() -> Path:
    """The shipped trained ``tiny-flux`` directory. Raises ``FileNotFoundError`` if the
    package was installed without it (retrain with ``python -m pipeline.tiny.train``)."""
    if not (TRAINED_TINY_FLUX / "model_index.json").exists():
        raise FileNotFoundError(f"the trained tiny-flux is missing from {TRAINED_TINY_FLUX}; recreate it with "
                                f"`python -m pipeline.tiny.train --out {TRAINED_TINY_FLUX}`")
    return TRAINED_TINY_FLUX


@dataclass(frozen=True)
class EmbeddedModel:
    """An embedded checkpoint: its ``family`` (``pipeline.families.REGISTRY`` name) and
    ``build()``, which returns its diffusers directory (building it on first use)."""

    family: str
    build: Callable[[], Path]


EMBEDDED: dict[str, EmbeddedModel] = {
    TINY_FLUX: EmbeddedModel("flux", trained_tiny_flux),
    TINY_FLUX_RANDOM: EmbeddedModel("flux", ensure_tiny_flux),
    "tiny-wan": EmbeddedModel("wan", lambda: ensure_tiny_wan(arch=TinyWanArch())),
    # Wan 2.2 A14B-style: high-/low-noise experts switched at boundary_ratio
    "tiny-wan-moe": EmbeddedModel("wan", lambda: ensure_tiny_wan(arch=TinyWanArch(dual="boundary"))),
    # two transformers at every step (the second one guides)
    "tiny-wan-paired": EmbeddedModel("wan", lambda: ensure_tiny_wan(arch=TinyWanArch(dual="paired"))),
    # Wan 2.2 TI2V-style image-to-video (WanImageToVideoPipeline, expand_timesteps)
    "tiny-wan-i2v": EmbeddedModel("wan", lambda: ensure_tiny_wan(arch=TinyWanArch(i2v=True))),
    # FLUX.1 Kontext-style reference editing: the trained tiny-flux weights as a FluxKontextPipeline
    "tiny-flux-kontext": EmbeddedModel("flux-kontext", lambda: ensure_tiny_flux_kontext(trained_tiny_flux())),
    # FLUX.2 [dev]-style: Mistral 3 text encoder, 4-axis ids, batch-normalised patchified latents
    TINY_FLUX2: EmbeddedModel("flux2", ensure_tiny_flux2),
    # Qwen-Image-style: Qwen2.5-VL text encoder, masked text, norm-rescaled true CFG
    TINY_QWEN_IMAGE: EmbeddedModel("qwen-image", ensure_tiny_qwen_image),
    # Qwen-Image-Edit-style reference editing: the image seen by the Qwen2.5-VL encoder and as latent tokens
    TINY_QWEN_IMAGE_EDIT: EmbeddedModel("qwen-image-edit", ensure_tiny_qwen_image_edit),
    # Z-Image (Turbo)-style: Qwen3 text encoder, single-stream DiT over per-sample sequences
    TINY_Z_IMAGE: EmbeddedModel("z-image", ensure_tiny_z_image),
}


def resolve_checkpoint(name: str, path: str | None) -> Path:
    """The checkpoint directory to load: ``path`` if given, else the embedded model of that name.

    ``path`` is a local diffusers directory, or a hub id (``black-forest-labs/FLUX.1-dev``)
    already in this node's Hugging Face cache, resolved to its cached snapshot
    (``huggingface_hub.snapshot_download(local_files_only=True)``): ditserve downloads nothing,
    and what loads is what the cache holds. Raises ``FileNotFoundError`` naming ``model.path``
    for a path that is neither, a directory without ``model_index.json``, or an unknown name
    without a path.
    """
    if path is None:
        if name not in EMBEDDED:
            raise FileNotFoundError(f"model {name!r} needs a checkpoint path (embedded: {', '.join(EMBEDDED)})")
        return EMBEDDED[name].build()
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "model_index.json").exists():
            raise FileNotFoundError(f"model.path {path}: {local} is not a diffusers checkpoint (no model_index.json)")
        return local
    if local.is_absolute() or str(path).startswith(("~", ".")):
        raise FileNotFoundError(f"model.path {path}: no such directory on this node")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except (LocalEntryNotFoundError, ValueError):  # not cached; not a hub id (HFValidationError)
        raise FileNotFoundError(f"model.path {path!r} is neither a directory on this node nor a hub id in its "
                                "Hugging Face cache (ditserve downloads nothing: `hf download "
                                f"{path} --local-dir DIR` on a machine that is online, then give DIR)") from None


if __name__ == "__main__":
    for model in EMBEDDED.values():
        print(model.build())
