"""Tools for training the embedded tiny-flux: the procedural dataset, the scorer, a reproducible trainer."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pipeline.contract.images import validate_image_request
from pipeline.contract.limits import ServingLimits
from pipeline.runner import BatchRunner
from pipeline.sampling import resolve
from pipeline.tiny.data import all_scenes, make_dataset, split_scenes
from pipeline.tiny.score import read_image
from pipeline.wire import Batch
from tests.helpers import batch_of


def test_scorer_reads_the_generator():
    images, scenes = make_dataset(all_scenes(), 200, seed=7)
    readings = [read_image(im) for im in images]
    assert all(r["color"] == s.color and r["background"] == s.background for r, s in zip(readings, scenes, strict=True))
    assert np.mean([r["shape"] == s.shape for r, s in zip(readings, scenes, strict=True)]) >= 0.95


def test_training_script_is_deterministic_on_a_handful_of_samples(tmp_path):
    from pipeline.tiny.train import train

    a = train(tmp_path / "a", images=16, vae_steps=2, dit_steps=2, log=lambda *_: None)
    b = train(tmp_path / "b", images=16, vae_steps=2, dit_steps=2, log=lambda *_: None)
    from diffusers import FluxTransformer2DModel

    ta = FluxTransformer2DModel.from_pretrained(a / "transformer")
    tb = FluxTransformer2DModel.from_pretrained(b / "transformer")
    assert all(torch.equal(x, y) for x, y in zip(ta.state_dict().values(), tb.state_dict().values(), strict=True))
    out = BatchRunner("tiny-flux", path=str(a)).run(_batch())[0]
    assert Image.open(io.BytesIO(out.images[0])).size == (64, 64)


def _batch() -> Batch:
    limits = ServingLimits("tiny-flux", 8, 64, 64, 2, 3.5)
    p = resolve(validate_image_request({"prompt": "a red circle", "seed": 1}, limits), limits)
    return batch_of(p, batch_id="t")


def test_held_out_scenes_never_appear_in_training():
    train, held_out = split_scenes()
    assert len(held_out) == 50 and not {s.caption for s in train} & {s.caption for s in held_out}


REFERENCE = Path(__file__).parent / "data" / "tiny_flux_reference.png"


def _generate(prompt: str, seed: int, steps: int = 16) -> np.ndarray:
    runner = BatchRunner("tiny-flux")
    limits = ServingLimits("tiny-flux", runner.facts().spatial_factor, 64, 64, steps, 3.5)
    p = resolve(validate_image_request({"prompt": prompt, "seed": seed}, limits), limits)
    out = runner.run(batch_of(p, batch_id="ref"))[0]
    return np.asarray(Image.open(io.BytesIO(out.images[0])).convert("RGB"))


def test_shipped_tiny_flux_matches_its_reference_image():
    """The shipped weights with the server defaults (64x64, 16 steps, guidance 3.5, seed 0)
    reproduce the stored image: a change to the loop, scheduler or weights that alters the
    output is caught (tolerance: float differences between CPUs)."""
    from deployments.cli import DEMO_PROMPT

    image = _generate(DEMO_PROMPT, seed=0)
    reference = np.asarray(Image.open(REFERENCE).convert("RGB"))
    diff = np.abs(image.astype(int) - reference.astype(int))
    assert diff.max() <= 4 and diff.mean() <= 0.5, (diff.max(), diff.mean())
    seen = read_image(image)
    assert (seen["color"], seen["background"]) == ("red", "blue")


def test_shipped_tiny_flux_draws_held_out_prompts():
    """Over the 50 held-out captions (never trained on), the scorer agrees with the colour."""
    from pipeline.tiny.evaluate import evaluate

    result = evaluate(BatchRunner("tiny-flux"), steps=16, prompts=50)
    assert result["color"] >= 0.9 and result["background"] >= 0.9, result
