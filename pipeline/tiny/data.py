"""A procedural dataset made on the spot: one coloured shape on a coloured background, 64×64.

Captions read ``"a {colour} {shape} on a {background} background"``. Everything derives from
a seed; nothing is downloaded. Used to train the embedded tiny-flux and to score it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (240, 220, 40),
    "purple": (140, 50, 190), "orange": (245, 140, 20), "white": (245, 245, 245), "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "star")


@dataclass(frozen=True)
class Scene:
    color: str
    shape: str
    background: str

    @property
    def caption(self) -> str:
        return f"a {self.color} {self.shape} on a {self.background} background"


def all_scenes() -> list[Scene]:
    return [Scene(c, s, b) for c in COLORS for s in SHAPES for b in COLORS if b != c]


def split_scenes(seed: int = 0, held_out: int = 50) -> tuple[list[Scene], list[Scene]]:
    """(train, held-out) scene lists; held-out captions never appear in training."""
    scenes = all_scenes()
    random.Random(seed).shuffle(scenes)
    return scenes[held_out:], scenes[:held_out]


# Styles the embedded LoRA adapters learn (pipeline.tiny.lora): "plain" is what the base model
# learned; "magenta" fills every shape with a colour it never saw, whatever the caption says;
# "outline" keeps the caption's colour and draws a thick black outline around the shape.
STYLES = ("plain", "magenta", "outline")
MAGENTA = (230, 30, 230)
OUTLINE_WIDTH = 3  # pixels


def draw(scene: Scene, rng: random.Random, style: str = "plain") -> Image.Image:
    """The scene at a random position and size (radius 9..16 pixels), as an RGB image, in
    ``style`` (one of ``STYLES``)."""
    image = Image.new("RGB", (SIZE, SIZE), COLORS[scene.background])
    pen = ImageDraw.Draw(image)
    r = rng.uniform(9, 16)
    cx, cy = rng.uniform(r + 2, SIZE - r - 2), rng.uniform(r + 2, SIZE - r - 2)
    fill = MAGENTA if style == "magenta" else COLORS[scene.color]
    ink = {"outline": (0, 0, 0), "width": OUTLINE_WIDTH} if style == "outline" else {}
    if scene.shape == "circle":
        pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill, **ink)
    elif scene.shape == "square":
        s = r * 0.9
        pen.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill, **ink)
    elif scene.shape == "triangle":
        pen.polygon([(cx + r * math.cos(a), cy + r * math.sin(a))
                     for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)], fill=fill, **ink)
    else:  # five-pointed star
        points = []
        for i in range(10):
            a = -math.pi / 2 + i * math.pi / 5
            rad = r if i % 2 == 0 else r * 0.42
            points.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        pen.polygon(points, fill=fill, **ink)
    return image


def make_dataset(scenes: list[Scene], count: int, seed: int, style: str = "plain") -> tuple[np.ndarray, list[Scene]]:
    """``count`` images (count, 64, 64, 3) uint8 drawn from ``scenes`` in ``style``, and their scenes."""
    rng = random.Random(seed)
    chosen = [rng.choice(scenes) for _ in range(count)]
    return np.stack([np.asarray(draw(s, rng, style)) for s in chosen]), chosen
