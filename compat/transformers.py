"""transformers internals ditserve relies on beyond its public API (tested range: ``TESTED``).

- Processor attributes (``ProcessorMixin.get_attributes``) are the modality arguments of the
  processor class's ``__init__``. :func:`qwen2vl_processor` relies on it to build Qwen-Image-Edit's
  ``Qwen2VLProcessor`` without its video processor where torchvision is missing: transformers'
  video processors need torchvision (``VideoProcessorMixin`` is not even exported without it),
  and PyPI's torchvision does not import beside the CPU build of torch these machines use.
  Qwen-Image-Edit gives the processor images and text only, never videos.
"""

from __future__ import annotations

from pathlib import Path

from compat import Reliance, missing

DISTRIBUTION = "transformers"
TESTED = ">=5.24,<6"

RELIES_ON = (
    Reliance("transformers.processing_utils", "ProcessorMixin.get_attributes", "processor attributes from __init__"),
    Reliance("transformers", "Qwen2VLProcessor", "Qwen-Image-Edit's prompt processor"),
    Reliance("transformers", "Qwen2VLImageProcessorPil", "its image processor without torchvision"),
)


def check() -> list[str]:
    """What the installed transformers lacks of :data:`RELIES_ON` (empty: nothing)."""
    return missing(DISTRIBUTION, TESTED, RELIES_ON)


def has_torchvision() -> bool:
    """Whether torchvision imports here (transformers' video processors need it)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or a build that does not match this torch (RuntimeError)
        return False
    return True


def image_only_qwen2vl_processor_class():
    """``Qwen2VLProcessor`` whose attributes are its image processor and tokenizer only."""
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor without a video processor (images and text only)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=chat_template, **kwargs)

    # A checkpoint saved with it records the class a loader with torchvision finds
    # (model_index.json's ["transformers", "Qwen2VLProcessor"], processor_config.json's processor_class).
    ImageOnlyQwen2VLProcessor.__name__ = ImageOnlyQwen2VLProcessor.__qualname__ = Qwen2VLProcessor.__name__
    ImageOnlyQwen2VLProcessor.__module__ = Qwen2VLProcessor.__module__
    return ImageOnlyQwen2VLProcessor


def qwen2vl_processor(path: str | Path):
    """The ``Qwen2VLProcessor`` of a Qwen-Image-Edit checkpoint's ``processor/`` directory.

    With torchvision, transformers' own ``Qwen2VLProcessor.from_pretrained``. Without it, the
    same class built from the directory's image processor (the Pillow backend,
    ``Qwen2VLImageProcessorPil``, configured from its saved config) and tokenizer, with no video
    processor (:func:`image_only_qwen2vl_processor_class`). Raises ``OSError`` when the
    directory holds no processor."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    path = Path(path)
    if has_torchvision():
        return Qwen2VLProcessor.from_pretrained(str(path))
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return image_only_qwen2vl_processor_class()(image_processor=image_processor, tokenizer=tokenizer)
