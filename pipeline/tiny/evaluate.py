"""Score the embedded tiny-flux on held-out prompts: does each image show its prompt?

    python -m pipeline.tiny.evaluate [--model DIR] [--steps 16] [--prompts 50]

Generates one image per held-out caption (never seen in training) with the server's
default settings and reads it back with ``pipeline.tiny.score``; prints colour, background
and shape accuracy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from pipeline.contract.images import validate_image_request
from pipeline.contract.limits import ServingLimits
from pipeline.runner import BatchRunner
from pipeline.sampling import resolve
from pipeline.signature import BatchSignature
from pipeline.tiny.data import split_scenes
from pipeline.tiny.score import read_image
from pipeline.wire import Batch


def evaluate(runner: BatchRunner, *, steps: int = 16, prompts: int = 50, seed: int = 0, batch: int = 10) -> dict:
    """Accuracies over ``prompts`` held-out scenes: {"color", "background", "shape", "n"}."""
    import io

    from PIL import Image

    _, held_out = split_scenes(seed)
    scenes = held_out[:prompts]
    limits = ServingLimits("tiny-flux", runner.facts().spatial_factor, 64, 64, steps, 3.5)
    hits = {"color": 0, "background": 0, "shape": 0}
    for start in range(0, len(scenes), batch):
        chunk = scenes[start:start + batch]
        params = tuple(resolve(validate_image_request({"prompt": s.caption, "seed": start + i}, limits), limits)
                       for i, s in enumerate(chunk))
        outputs = runner.run(Batch("eval", BatchSignature.of(params[0]), params))
        for scene, out in zip(chunk, outputs, strict=True):
            seen = read_image(np.asarray(Image.open(io.BytesIO(out.images[0])).convert("RGB")))
            hits["color"] += seen["color"] == scene.color
            hits["background"] += seen["background"] == scene.background
            hits["shape"] += seen["shape"] == scene.shape
    return {k: v / len(scenes) for k, v in hits.items()} | {"n": len(scenes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="diffusers directory (default: the embedded tiny-flux)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=50)
    ns = ap.parse_args()
    runner = BatchRunner("tiny-flux", path=str(ns.model) if ns.model else None)
    result = evaluate(runner, steps=ns.steps, prompts=ns.prompts)
    print(f"{result['n']} held-out prompts, {ns.steps} steps: colour {result['color']:.0%}, "
          f"background {result['background']:.0%}, shape {result['shape']:.0%}")


if __name__ == "__main__":
    main()
