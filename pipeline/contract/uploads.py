"""Uploaded images: decoded, checked and resized with Pillow in the Ingress (torch-free).

A replica only ever receives :class:`pipeline.wire.ImageArray` values at the request's size.
Every problem is an ``InvalidRequestError`` (400) naming the field (``image``, ``mask``,
``input_reference``), raised before anything is queued:

- not an image, or a format other than PNG, JPEG or WebP (OpenAI's accepted formats);
- truncated or corrupt data (Pillow refuses truncated files by default); a JPEG with more than
  ``MAX_JPEG_SCANS`` scans (a progressive "scan bomb" decodes for minutes in a few MB, as
  libjpeg-turbo's ``-maxscans`` guards against);
- more pixels than ``limits.max_input_pixels``, read from the header *before* decoding, so
  a decompression bomb (a small file declaring a huge canvas) is never expanded; Pillow's own
  ``DecompressionBombError`` is mapped the same way;
- pixel modes: RGB, RGBA, L, LA, P, PA, 1, CMYK and YCbCr convert to RGB, 16-bit and 32-bit
  grey (I;16, I) are scaled to 8 bits; float images (F) and others are refused by name;
- a mask without an alpha channel (OpenAI's convention: alpha 0 marks the region to repaint),
  or of another size than its image.

EXIF orientation is applied (a photo is used as it is displayed). Masks are binarised to
OpenAI's convention: only fully transparent pixels (alpha 0) are repainted. Resizing: the image
is scaled to cover ``width`` × ``height`` and centre-cropped (Pillow's ``ImageOps.fit``: Lanczos
for images, nearest for masks, so a mask stays binary).
"""

from __future__ import annotations

import io
import math

from PIL import Image, ImageOps, UnidentifiedImageError

from pipeline.errors import InvalidRequestError
from pipeline.wire import ImageArray

FORMATS = ("PNG", "JPEG", "WEBP")  # OpenAI's edits accept png, jpg and webp
MAX_JPEG_SCANS = 100  # baseline JPEGs have 1 scan, progressive ones about 10
_TO_RGB = {"RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr"}
_WIDE_GREY = {"I;16", "I;16B", "I;16L", "I;16N", "I"}


def _bad(field: str, message: str, code: str = "invalid_image") -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {message}", param=field, code=code)


def open_image(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """``data`` decoded by Pillow (first frame of an animation), its size checked against
    ``max_pixels`` before the pixels are decoded. Raises ``InvalidRequestError``."""
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise _bad(field, "an image file is required (PNG, JPEG or WebP)")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise _bad(field, f"image is {width}x{height} ({width * height} pixels); at most {max_pixels} "
                              "pixels are accepted (limits.max_input_pixels)", code="image_too_large")
        # SOS markers (0xFF is stuffed elsewhere); Pillow names a JPEG with an MPF header (phones
        # write one) "MPO" (helper-63: such a scan bomb passed)
        if image.format in ("JPEG", "MPO") and data.count(b"\xff\xda") > MAX_JPEG_SCANS:
            raise _bad(field, f"the JPEG has more than {MAX_JPEG_SCANS} scans; re-encode it (baseline or progressive)")
        image.load()
        image = ImageOps.exif_transpose(image)  # as displayed
    except InvalidRequestError:
        raise
    except Image.DecompressionBombError:
        raise _bad(field, "image declares more pixels than are accepted (decompression bomb)",
                   code="image_too_large") from None
    except UnidentifiedImageError:
        raise _bad(field, f"not an image in an accepted format ({', '.join(f.lower() for f in FORMATS)})") from None
    except (OSError, SyntaxError, ValueError, EOFError, ZeroDivisionError) as exc:  # truncated or corrupt data
        raise _bad(field, f"the image could not be decoded ({str(exc)[:120] or type(exc).__name__})") from None
    return image


def to_rgb(image: Image.Image, field: str) -> Image.Image:
    """``image`` as 8-bit RGB (alpha dropped; 16/32-bit grey scaled). Raises
    ``InvalidRequestError`` for a pixel mode that cannot be converted faithfully."""
    if image.mode in _WIDE_GREY:
        import numpy as np

        values = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or values.max(initial=0) > 255 else 255.0
        grey = np.clip(np.rint(values * (255.0 / top)), 0, 255).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    if image.mode not in _TO_RGB:
        raise _bad(field, f"pixel mode {image.mode!r} is not accepted; send 8-bit RGB, RGBA, greyscale, palette "
                          "or CMYK, or 16-bit greyscale", code="unsupported_image_mode")
    return image.convert("RGB")


def alpha_of(mask: Image.Image, field: str = "mask") -> Image.Image:
    """The mask's alpha channel as an 8-bit "L" image, binarised to OpenAI's convention: 0 where
    the mask is fully transparent (repainted), 255 everywhere else (kept). Raises
    ``InvalidRequestError`` when the mask has no alpha."""
    has_alpha = mask.mode in ("RGBA", "LA", "PA") or (mask.mode in ("P", "L", "RGB") and "transparency" in mask.info)
    if not has_alpha:
        raise _bad(field, f"the mask has no alpha channel (mode {mask.mode!r}); send a PNG with transparency "
                          "whose fully transparent pixels (alpha 0) mark the region to repaint",
                   code="invalid_mask")
    return mask.convert("RGBA").getchannel("A").point(lambda a: 0 if a == 0 else 255)


def fitted(image: Image.Image, width: int, height: int, *, mask: bool = False) -> ImageArray:
    """``image`` (RGB, or an "L" mask) scaled to cover ``width`` × ``height`` pixels and
    centre-cropped, as an :class:`ImageArray`."""
    method = Image.Resampling.NEAREST if mask else Image.Resampling.LANCZOS
    if image.size != (width, height):
        image = ImageOps.fit(image, (width, height), method=method, centering=(0.5, 0.5))
    channels = 1 if mask else 3
    return ImageArray(width, height, channels, image.tobytes())


def auto_size(width: int, height: int, spatial_factor: int, max_pixels: int, field: str = "image") -> tuple[int, int]:
    """The output size for an input of ``width`` × ``height`` when the request gives no
    ``size``: the input's own size, scaled down to at most ``max_pixels`` (keeping its aspect)
    and rounded down to multiples of ``spatial_factor``. Raises ``InvalidRequestError`` when
    that leaves less than one multiple on a side (a side under it, or, scaled down, a long thin
    image's short side: helper-75, 8x131072 was told each side must be at least 8)."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    w = int(width * scale) // spatial_factor * spatial_factor
    h = int(height * scale) // spatial_factor * spatial_factor
    if min(width, height) < spatial_factor:
        raise _bad(field, f"image is {width}x{height}; each side must be at least {spatial_factor} pixels "
                          f"(or give size)", code="image_too_small")
    if w < spatial_factor or h < spatial_factor:
        raise _bad(field, f"image is {width}x{height}: scaled down to at most {max_pixels} pixels, its short side "
                          f"is under {spatial_factor} pixels (too long and thin); give size, or send an image of "
                          f"aspect ratio at most {max_pixels // spatial_factor ** 2}:1", code="image_too_small")
    return w, h
