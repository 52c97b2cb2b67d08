"""Qwen-Image-Edit on its embedded tiny model (tiny-qwen-image-edit): reference editing on our
batched loop equals diffusers' ``QwenImageEditPipeline``, batches of different images equal each
alone, the accelerations (Cache-DiT, CFG gating, a kernel override) run on edits, 2 ranks
(Ulysses, ring) equal 1 rank, the contract refuses what the model cannot do, and the OpenAI
SDK's ``images.edit`` is served. The processor is built without torchvision where it is missing
(``compat.transformers``)."""

from __future__ import annotations

import dataclasses
import io
import random

import numpy as np
import pytest
import ray
import torch
from PIL import Image

from pipeline.cache_dit_params import CacheDiTParams
from pipeline.contract.edits import validate_edit_request
from pipeline.contract.images import validate_image_request
from pipeline.errors import InvalidRequestError
from pipeline.loop import denoise_batch
from pipeline.modes import InputMode
from pipeline.runner import BatchRunner
from pipeline.sampling import resolve_edit
from pipeline.tiny.data import Scene, draw
from pipeline.wire import ImageArray
from tests.helpers import batch_of, flux_params, rank_workers
from tests.helpers import pixels as png_pixels

MODEL = "tiny-qwen-image-edit"
TOL = 1e-4
LIMITS = {"default_size": "32x32", "default_steps": 4, "default_guidance_scale": 4.0, "max_n": 4,
          "max_pixels": 128 * 128, "max_steps": 50, "max_prompt_chars": 500, "default_num_frames": 1,
          "default_fps": 8, "max_frames": 1}


def scene(color: str, shape: str, background: str, seed: int = 0, size=(32, 32)) -> Image.Image:
    return draw(Scene(color, shape, background), random.Random(seed)).resize(size)


def edit(prompt: str, seed: int, image: Image.Image, **fields):
    """A resolved reference edit of ``image`` (its size is the output size)."""
    array = ImageArray(image.width, image.height, 3, image.convert("RGB").tobytes())
    p = flux_params(prompt, seed, size=image.size, guidance=None, input_mode=InputMode.REFERENCE, num_input_images=1,
                    images=(array,), **fields)
    return dataclasses.replace(p, model=MODEL)


@pytest.fixture(scope="module")
def runner():
    return BatchRunner(MODEL)


def diffusers_edit(pipe, p, image: Image.Image) -> np.ndarray:
    kwargs = {"negative_prompt": p.negative_prompt, "true_cfg_scale": p.cfg_scale} if p.guided else {}
    return pipe(image=image, prompt=p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                num_images_per_prompt=p.n, generator=torch.Generator().manual_seed(p.seed), output_type="np",
                **kwargs).images


def test_edit_equals_the_diffusers_pipeline_and_a_batch_equals_each_alone(runner):
    family = runner.family
    assert type(family.pipe).__name__ == "QwenImageEditPipeline" and family.requires_image
    images = [scene("red", "circle", "yellow"), scene("green", "star", "blue", 1)]
    batch = [edit("make it blue", 3, images[0], n=2, negative="blurry", true_cfg_scale=3.0, steps=2),
             edit("a much longer instruction: turn the star into a white square at night", 4, images[1],
                  negative="a very blurry photo", true_cfg_scale=3.0, steps=2)]
    together = denoise_batch(family, batch).images
    for i, (p, ours) in enumerate(zip(batch, together, strict=True)):
        alone = denoise_batch(family, [p]).images[0]
        if i == 0:  # the guided n=2 edit, as diffusers runs it
            assert np.abs(alone - diffusers_edit(family.pipe, p, images[0])).max() <= TOL
        assert np.abs(ours - alone).max() <= TOL
    # the image conditions the prompt (its vision tokens) and the sequence (its latents)
    a, b = (family.encode_prompts([batch[0].prompt], [q.images]).prompt_embeds for q in batch)
    assert a.shape != b.shape or (a - b).abs().max() > 1e-3
    g = [torch.Generator().manual_seed(0) for _ in range(2)]
    refs = [family.prepare_latents([gen], [1], q, requests=[q])[1].reference for gen, q in zip(g, batch)]
    assert (refs[0] - refs[1]).abs().max() > 1e-3


def test_accelerations_run_on_edits(runner):
    """Cache-DiT mounts through cache-dit's Qwen-Image adapter, the CFG gate reuses the guide,
    a kernel override switches every layer (the same pixels within one level)."""
    image = scene("red", "circle", "yellow")
    p = edit("make it blue", 1, image, negative="blurry", true_cfg_scale=3.0, steps=2)
    exact = runner.run(batch_of(p))[0]
    knobs = CacheDiTParams(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1, scm_compute_bins=[1],
                           scm_cache_bins=[1], residual_diff_threshold=10.0)
    cached = runner.run(batch_of(dataclasses.replace(p, enable_cache_dit=True, cache_dit_params=knobs)))[0]
    report = cached.acceleration.cache_dit
    assert report.transition == "mount" and report.cached_steps == 1 and report.computed_steps == 1
    assert cached.images != exact.images
    gated = runner.run(batch_of(dataclasses.replace(p, cfg_gate_fraction=0.5)))[0]
    assert gated.acceleration.cache_dit.transition == "unmount" and gated.acceleration.cfg_gate.reused_steps == 1
    math = runner.run(batch_of(dataclasses.replace(p, attention_backend="torch_math")))[0]
    assert math.acceleration.attention_backend == "torch_math"
    assert np.abs(png_pixels(math.images[0]).astype(int) - png_pixels(exact.images[0]).astype(int)).max() <= 1


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_the_contract_refuses_what_it_cannot_do(runner):
    from pipeline.families import detect_family
    from pipeline.tiny.registry import EMBEDDED

    assert detect_family(EMBEDDED[MODEL].build()) == "qwen-image-edit"  # model_index.json's QwenImageEditPipeline
    limits = runner.facts().limits(MODEL, LIMITS)
    assert limits.requires_image and limits.input_modes == (InputMode.REFERENCE,)
    with pytest.raises(InvalidRequestError, match="edits images and needs one") as err:
        validate_image_request({"prompt": "x"}, limits)
    assert err.value.param == "model"
    image = _png(scene("red", "circle", "yellow"))
    with pytest.raises(InvalidRequestError, match="strength: reference editing"):
        validate_edit_request({"prompt": "x", "image": image, "strength": 0.5}, limits)
    with pytest.raises(InvalidRequestError, match="does not inpaint"):
        validate_edit_request({"prompt": "x", "image": image, "mask": image}, limits)
    p = resolve_edit(validate_edit_request({"prompt": "x", "image": image, "seed": 2}, limits), limits)
    assert p.input_mode == InputMode.REFERENCE and (p.width, p.height) == (32, 32) and p.num_input_images == 1
    # Qwen2-VL's processor refuses an image over 200:1, and the ~1 MP edit resize stretches an output
    # past ~164:1 to that: 16x2624 and a 16x4000 image (auto size) passed, then failed in the batch,
    # reported as a prompt the tokenizer could not encode
    wide = runner.facts().limits(MODEL, {**LIMITS, "max_pixels": 65536, "max_input_pixels": 65536})
    assert wide.max_aspect_ratio == 128
    with pytest.raises(InvalidRequestError, match=r"size 16x2624 is 164:1; this model takes at most 128:1") as err:
        validate_edit_request({"prompt": "x", "image": image, "size": "16x2624"}, wide)
    assert err.value.param == "size"
    elongated = _png(Image.new("RGB", (16, 4000), (200, 40, 40)))
    with pytest.raises(InvalidRequestError, match=r"image: the output size 16x4000 is 250:1") as err:
        resolve_edit(validate_edit_request({"prompt": "x", "image": elongated}, wide), wide)
    assert err.value.param == "image"
    assert resolve_edit(validate_edit_request({"prompt": "x", "image": image, "size": "16x2048"}, wide), wide).height == 2048


def test_compile_after_mount_once_and_the_replica_warms_up_on_an_edit():
    """An edit-only model's warmup batch (a replica's, before torch.compile traces) is an edit of a
    grey image at the default size; Cache-DiT mounts first, then one compile."""
    from deployments.replica import default_params

    compiled = BatchRunner(MODEL, torch_compile=True, compile_backend="eager")
    acceleration = {"enable_cache_dit": True, "cache_dit_params": {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0,
                                                                   "max_warmup_steps": 1}}
    head = default_params(MODEL, acceleration, {**LIMITS, "default_steps": 2}, compiled.facts())
    assert head.input_mode == InputMode.REFERENCE and (head.width, head.height) == (32, 32) and head.enable_cache_dit
    compiled.warmup(head)
    assert [e[1] for e in compiled.events][:2] == ["mount", "compile"]
    compiled.run(batch_of(dataclasses.replace(head, request_id="again", seed=1)))
    assert compiled.compiles == 1


def test_layouts_that_cannot_split_every_edit_are_refused_at_startup(runner):
    """3 ranks cannot always split an edit's reference tokens (a multiple of 4): refused before
    any group is touched, naming the degrees."""
    from parallel.config import ParallelConfig

    with pytest.raises(ValueError, match="ulysses_degree x ring_degree = 3 must divide 4"):
        runner.family.enable_sequence_parallel(ParallelConfig(ring_degree=3), None, 0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"ulysses_degree": 2, "ring_degree": 1}, {"ulysses_degree": 1, "ring_degree": 2}],
                         ids=["ulysses2", "ring2"])
def test_two_ranks_equal_one_rank(ray_cluster, runner, layout):
    """The reference tokens split with the sample's; the text (vision tokens and prompts of
    different lengths) is masked across the ranks."""
    batch = batch_of(edit("make it blue", 3, scene("red", "circle", "yellow"), negative="blurry",
                          true_cfg_scale=3.0, steps=2),
                     edit("a green star at night on a black background", 4, scene("white", "square", "red", 2),
                          negative="a very blurry photo", true_cfg_scale=3.0, steps=2))
    single = runner.denoise(batch)
    workers = rank_workers(layout, MODEL)
    try:
        sharded = ray.get([w.denoise.remote(batch) for w in workers], timeout=300)[0]
        for a, b in zip(single.images, sharded.images, strict=True):
            assert np.abs(a - b).max() <= 5e-4 and np.abs(a - b).mean() <= 5e-5
    finally:
        for w in workers:
            ray.kill(w)


@pytest.mark.slow
def test_served_through_the_openai_sdk(deploy):
    """configs/tiny-qwen-image-edit-cpu.yaml: ``images.edit`` answers; ``images.generate`` is a
    400 naming ``model``."""
    from pathlib import Path

    import openai
    import yaml

    from tests.helpers import openai_client

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" /
                             "tiny-qwen-image-edit-cpu.yaml").read_text())
    args = config["applications"][0]["args"]
    args["replica"]["torch_threads"] = 2
    url = deploy(args)
    client = openai_client(url)
    image = _png(scene("red", "circle", "yellow", size=(64, 48)))
    response = client.images.edit(image=("in.png", image), prompt="make it blue",
                                  extra_body={"seed": 1, "num_inference_steps": 2})
    assert png_pixels(response.data[0].b64_json).shape == (48, 64, 3)
    assert "reference" in response.model_extra["ditserve"]["signature"]
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="a red circle")
    assert err.value.body["param"] == "model"
