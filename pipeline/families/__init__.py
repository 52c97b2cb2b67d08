"""Model families by name: one module per family, one line per family in :data:`REGISTRY`.

Each family class satisfies ``pipeline.families.base.ModelFamily``; its whole story lives in
its own module, which is imported only when the family is used.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

# name -> "module:class"
REGISTRY: dict[str, str] = {
    "flux": "pipeline.families.flux:FluxFamily",
    "flux-kontext": "pipeline.families.flux:FluxKontextFamily",
    "flux2": "pipeline.families.flux2:Flux2Family",
    "qwen-image": "pipeline.families.qwen_image:QwenImageFamily",
    "qwen-image-edit": "pipeline.families.qwen_image:QwenImageEditFamily",
    "z-image": "pipeline.families.z_image:ZImageFamily",
    "wan": "pipeline.families.wan:WanFamily",
}


def family_class(name: str) -> type:
    """The class registered as ``name``. Raises ``ValueError`` for an unknown name."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(REGISTRY)}")
    module, _, cls = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def model_index(path: str | Path) -> dict:
    """The ``model_index.json`` of the diffusers checkpoint directory ``path`` (a hub id is
    resolved to its cached directory first: ``pipeline.tiny.registry.resolve_checkpoint``).
    Raises ``ValueError`` when the directory has none."""
    index = Path(path).expanduser() / "model_index.json"
    if not index.is_file():
        raise ValueError(f"{path} has no model_index.json: not a diffusers checkpoint directory")
    return json.loads(index.read_text())


def detect_family(path: str | Path) -> str:
    """Family of a diffusers checkpoint directory, from ``model_index.json``'s ``_class_name``.

    Raises ``ValueError`` if no registered family serves that pipeline class, or if the
    checkpoint has no ``model_index.json`` here.
    """
    class_name = model_index(path)["_class_name"]
    for name in REGISTRY:
        if class_name in family_class(name).pipeline_classes:
            return name
    served = sorted(c for name in REGISTRY for c in family_class(name).pipeline_classes)
    raise ValueError(f"no ditserve family serves pipeline class {class_name!r}; served: {', '.join(served)}")


def load_family(name: str, path: str | Path, *, torch_dtype, device, **options):
    """Load the checkpoint at ``path`` with the family registered as ``name``; ``options`` go
    to its ``from_pretrained`` (e.g. Wan's ``dual_transformer``)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    cls = family_class(name)
    diffusers_logging.disable_progress_bar()  # no per-component progress bars in server logs
    transformers_logging.disable_progress_bar()
    # Their warnings echo request text (a truncated prompt is logged whole): one client could
    # flood the replica's log. Errors still show.
    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    return cls.from_pretrained(path, torch_dtype=torch_dtype, device=device, **options)


# The key of a diffusers transformer config.json that holds its attention heads per layer:
# ``num_attention_heads`` (Flux, Flux2, QwenImage, Wan transformers), ``n_heads``
# (ZImageTransformer2DModel).
HEADS_CONFIG_KEYS = ("num_attention_heads", "n_heads")


def checkpoint_attention_heads(path: str | Path) -> int | None:
    """Attention heads per layer of the ``transformer`` of the diffusers directory ``path``,
    read from its ``transformer/config.json`` without loading anything (None when that file,
    or an integer under one of ``HEADS_CONFIG_KEYS``, is missing or unreadable: the loaded
    family's ``num_attention_heads`` decides then, and loading names what is wrong)."""
    config = Path(path) / "transformer" / "config.json"
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    heads = next((values[key] for key in HEADS_CONFIG_KEYS if isinstance(values, dict) and key in values), None)
    return heads if isinstance(heads, int) and not isinstance(heads, bool) else None
