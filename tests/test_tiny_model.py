"""Tools for training the embedded tiny-flux: the procedural dataset, the scorer, a reproducible trainer."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from pipeline.contract import ServingLimits, validate_image_request
from pipeline.runner import Batch, BatchRunner
from pipeline.sampling import resolve
from pipeline.signature import BatchSignature
from pipeline.tiny.data import all_scenes, make_dataset, split_scenes
from pipeline.tiny.score import read_image

def test_scorer_reads_the_generator():
    images, scenes = make_dataset(all_scenes(), 200, seed=7)
    readings = [read_image(im) for im in images]
    assert all(r["color"] == s.color and r["background"] == s.background for r, s in zip(readings, scenes))
    assert np.mean([r["shape"] == s.shape for r, s in zip(readings, scenes)]) >= 0.95


def test_training_script_is_deterministic_on_a_handful_of_samples(tmp_path):
    from pipeline.tiny.train import train

    a = train(tmp_path / "a", images=16, vae_steps=2, dit_steps=2, log=lambda *_: None)
    b = train(tmp_path / "b", images=16, vae_steps=2, dit_steps=2, log=lambda *_: None)
    from diffusers import FluxTransformer2DModel

    ta = FluxTransformer2DModel.from_pretrained(a / "transformer")
    tb = FluxTransformer2DModel.from_pretrained(b / "transformer")
    assert all(torch.equal(x, y) for x, y in zip(ta.state_dict().values(), tb.state_dict().values()))
    out = BatchRunner("tiny-flux", path=str(a)).run(_batch())[0]
    assert Image.open(io.BytesIO(out.pngs[0])).size == (64, 64)


def _batch() -> Batch:
    limits = ServingLimits("tiny-flux", 8, 64, 64, 2, 3.5)
    p = resolve(validate_image_request({"prompt": "a red circle", "seed": 1}, limits), limits)
    return Batch("t", BatchSignature.of(p), (p,))


def test_held_out_scenes_never_appear_in_training():
    train, held_out = split_scenes()
    assert len(held_out) == 50 and not {s.caption for s in train} & {s.caption for s in held_out}
