"""Does a generated image show its prompt? Pixel statistics, no learned model.

The background colour is the median of the border pixels; pixels far from it are the
foreground; the foreground's median colour is matched to the nearest named colour. Shape
is read from how much of its bounding box the foreground fills (square ≈ 0.8, circle ≈
0.79·…, triangle ≈ 0.5, star ≈ 0.35) together with the box's aspect ratio.
"""

from __future__ import annotations

import numpy as np

from pipeline.tiny.data import COLORS

_NAMES = list(COLORS)
_RGB = np.array([COLORS[n] for n in _NAMES], dtype=np.float64)


def nearest_color(rgb) -> str:
    return _NAMES[int(np.argmin(((_RGB - np.asarray(rgb, dtype=np.float64)) ** 2).sum(1)))]


def read_image(image: np.ndarray) -> dict:
    """image: (64, 64, 3) uint8 → {"color", "background", "shape", "coverage"}."""
    x = image.astype(np.float64)
    border = np.concatenate([x[0], x[-1], x[:, 0], x[:, -1]])
    background = np.median(border, axis=0)
    mask = np.sqrt(((x - background) ** 2).sum(-1)) > 60
    result = {"background": nearest_color(background), "coverage": float(mask.mean())}
    if mask.sum() < 12:
        return {**result, "color": None, "shape": None}
    result["color"] = nearest_color(np.median(x[mask], axis=0))
    ys, xs = np.nonzero(mask)
    h, w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    fill = mask.sum() / float(h * w)
    if fill > 0.86:
        shape = "square"
    elif fill > 0.66:
        shape = "circle"
    elif fill > 0.44:
        shape = "triangle"
    else:
        shape = "star"
    return {**result, "shape": shape, "fill": float(fill)}


def _foreground(x: np.ndarray) -> np.ndarray:
    """Pixels far (> 60 in RGB distance) from the border's median colour: (H, W) bool."""
    border = np.concatenate([x[0], x[-1], x[:, 0], x[:, -1]])
    return np.sqrt(((x - np.median(border, axis=0)) ** 2).sum(-1)) > 60


DARK_LUMINANCE = 50  # below every caption colour's luminance but black's (blue, the darkest: 78)


def style_scores(image: np.ndarray) -> dict:
    """What the embedded LoRA adapters change (``pipeline.tiny.lora``), read from pixels.

    image: (64, 64, 3) uint8 → ``magenta_distance``: RGB distance (0..441) of the foreground's
    median colour from ``MAGENTA`` (None without a foreground); ``dark_fraction``: the fraction
    of pixels darker (luminance, ITU-R BT.601) than ``DARK_LUMINANCE``, which only a black outline
    makes (for captions without black).
    """
    from pipeline.tiny.data import MAGENTA

    x = image.astype(np.float64)
    mask = _foreground(x)
    dark = float(((x @ np.array([0.299, 0.587, 0.114])) < DARK_LUMINANCE).mean())
    if mask.sum() < 12:
        return {"magenta_distance": None, "dark_fraction": dark}
    return {"magenta_distance": float(np.sqrt(((np.median(x[mask], axis=0) - MAGENTA) ** 2).sum())),
            "dark_fraction": dark}
