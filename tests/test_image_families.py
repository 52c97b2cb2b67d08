"""The further image families on their embedded tiny models (tiny-flux2: FLUX.2 [dev]
architecture; tiny-qwen-image: Qwen-Image; tiny-z-image: Z-Image): our loop equals the diffusers pipeline, batches
equal requests alone, and every acceleration (Cache-DiT through cache-dit's own adapter for the
transformer, true CFG with CFG gating, kernel overrides, torch.compile after mount, sequence
parallelism) runs. Each test runs once per family."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from compat import cache_dit as cache_dit_compat
from compat import diffusers as diffusers_compat
from pipeline.contract.images import validate_image_request
from pipeline.loop import denoise_batch
from pipeline.runner import BatchRunner
from pipeline.sampling import AccelerationDefaults, resolve
from pipeline.cache_dit_params import CacheDiTParams
from pipeline.modes import GuidanceMode
from tests.helpers import batch_of, rank_workers
from tests.helpers import pixels as png_pixels

TOL = 1e-4
# model -> (family, spatial factor, text tokens)
FAMILIES = {"tiny-flux2": ("flux2", 4, 128), "tiny-qwen-image": ("qwen-image", 16, 512),
            "tiny-z-image": ("z-image", 4, 128)}
LIMITS = {"default_size": "64x48", "default_steps": 8, "default_guidance_scale": 4.0, "max_n": 4,
          "max_pixels": 128 * 128, "max_steps": 50, "max_prompt_chars": 500, "default_num_frames": 1,
          "default_fps": 8, "max_frames": 1}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runner(request):
    return BatchRunner(request.param)


def guided(runner, scale: float = 3.0) -> dict:
    """The request fields of a guided request on this family: true CFG, or CFG on guidance_scale."""
    if runner.family.guidance_style == GuidanceMode.TRUE_CFG:
        return {"negative_prompt": "blurry", "true_cfg_scale": scale}
    return {"negative_prompt": "blurry", "guidance_scale": scale}


def unguided(runner) -> dict:
    return {} if runner.family.guidance_style == GuidanceMode.TRUE_CFG else {"guidance_scale": 0.0}


def params(runner, prompt, seed, **body):
    """A request resolved through the contract, against the family's own facts."""
    limits = runner.facts().limits(runner.name, LIMITS)
    body = {"prompt": prompt, "seed": seed, "num_inference_steps": 6, **body}
    return resolve(validate_image_request(body, limits), limits)


def reference(family, p) -> np.ndarray:
    kwargs = {"max_sequence_length": family.max_sequence_length}
    if family.guidance_embeds:
        kwargs["guidance_scale"] = p.embedded_guidance_scale
    if family.guidance_style == GuidanceMode.CFG:
        kwargs["guidance_scale"] = p.cfg_scale if p.guided else 0.0
        if p.guided:
            kwargs["negative_prompt"] = p.negative_prompt
    elif p.negative_prompt is not None:
        kwargs.update(negative_prompt=p.negative_prompt, true_cfg_scale=p.cfg_scale)
    return family.pipe(prompt=p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                       num_images_per_prompt=p.n, generator=torch.Generator().manual_seed(p.seed),
                       output_type="np", **kwargs).images


def test_loop_equals_the_diffusers_pipeline_and_batches_equal_each_alone(runner):
    family = runner.family
    cfg = guided(runner) if family.family != "flux2" else {}
    batch = [params(runner, "a red circle", 3, n=2, **cfg),
             params(runner, "yellow star on a blue background at night", 4, **cfg), params(runner, "x", 5, **cfg)]
    assert all(p.guided == bool(cfg) for p in batch)
    together = denoise_batch(family, batch).images
    for p, ours in zip(batch, together, strict=True):
        alone = denoise_batch(family, [p]).images[0]
        assert np.abs(alone - reference(family, p)).max() <= TOL
        assert np.abs(ours - alone).max() <= TOL


def test_the_limits_come_from_the_family(runner):
    facts = runner.facts()
    family, factor, text_tokens = FAMILIES[runner.name]
    assert (facts.family, facts.spatial_factor, facts.text_tokens) == (family, factor, text_tokens)
    limits = facts.limits(runner.name, LIMITS)
    from pipeline.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=f"multiples of {factor}"):
        validate_image_request({"prompt": "x", "size": f"{factor * 4 + 2}x48"}, limits)


def test_family_rules_reach_the_contract(runner):
    """Kernels that take no attention mask are refused for masked families; Qwen-Image needs 2
    steps (its scheduler's terminal stretch is 0/0 at one); Z-Image guides with guidance_scale, so
    true_cfg_scale is refused there; Qwen-Image guides a negative prompt alone at its pipeline's 4.0."""
    from pipeline.errors import InvalidRequestError

    facts = runner.facts()
    limits = facts.limits(runner.name, LIMITS)
    masked = runner.family.masked_attention
    for kernel in ("fa", "sage_attn"):
        assert any("attention mask" in r for r in facts.attention_rejections.get(kernel, [])) == masked
    if runner.family.family == "qwen-image":
        with pytest.raises(InvalidRequestError, match="num_inference_steps must be between 2 and"):
            validate_image_request({"prompt": "x", "num_inference_steps": 1}, limits)
        p = resolve(validate_image_request({"prompt": "x", "negative_prompt": "blurry"}, limits), limits)
        assert p.guided and p.cfg_scale == 4.0
        with pytest.raises(InvalidRequestError, match="guidance_scale is not used"):  # no guidance embedding
            validate_image_request({"prompt": "x", "guidance_scale": 5.0}, limits)
    if runner.family.guidance_style != GuidanceMode.TRUE_CFG:
        with pytest.raises(InvalidRequestError, match="true_cfg_scale is not used"):
            validate_image_request({"prompt": "x", "true_cfg_scale": 3.0}, limits)


def _run(runner, **body):
    limits = runner.facts().limits(runner.name, LIMITS)
    p = resolve(validate_image_request({"prompt": "a red circle", "seed": 1, **body}, limits), limits,
                AccelerationDefaults())
    return runner.run(batch_of(p))[0]


def test_cache_dit_mounts_through_its_own_adapter(runner):
    # FLUX.2's two block lists are cached apart: with cache-dit's default Fn=8 (its shorter list
    # whole) the 16 single-stream blocks still leave 8 to cache, so the request below is taken
    assert runner.facts().longest_block_list == (16 if runner.name == "tiny-flux2" else 0)
    exact = _run(runner, **unguided(runner))
    cached = _run(runner, **unguided(runner), enable_cache_dit=True,
                  cache_dit_params={"scm_preset": "fast", "scm_policy": "static"})
    report = cached.acceleration.cache_dit
    assert report.transition == "mount" and report.cached_steps > 0
    assert report.cached_steps + report.computed_steps == 8
    assert cached.images != exact.images  # cached steps really skip blocks (an approximation)
    assert np.abs(png_pixels(cached.images[0]).astype(int) - png_pixels(exact.images[0]).astype(int)).mean() < 40
    back = _run(runner, **unguided(runner))
    assert back.acceleration.cache_dit.transition == "unmount" and back.images == exact.images
    assert not cache_dit_compat.is_mounted(runner.family.transformer)


def test_guidance_with_gating_and_a_kernel_override(runner):
    body = guided(runner)
    exact = _run(runner, **body)
    assert exact.acceleration.transformer_calls == {"transformer": 16}
    gated = _run(runner, **body, cfg_gate_step=0.5)
    assert gated.acceleration.cfg_gate.reused_steps == 4 and gated.images != exact.images
    math = _run(runner, **body, attention_backend_override="torch_math")
    assert math.acceleration.attention_backend == "torch_math"
    assert {diffusers_compat.get_processor_backend(p) for p in runner.attention.layers} == {"_native_math"}
    assert np.abs(png_pixels(math.images[0]).astype(int) - png_pixels(exact.images[0]).astype(int)).max() <= 1
    assert _run(runner, **body).images == exact.images  # back to the default kernel


@pytest.mark.parametrize("model", sorted(FAMILIES))
def test_compile_after_mount_once(model):
    compiled = BatchRunner(model, torch_compile=True, compile_backend="eager")
    on = AccelerationDefaults(enable_cache_dit=True, cache_dit_params=CacheDiTParams(scm_preset="fast",
                                                                                     scm_policy="static"))
    limits = compiled.facts().limits(model, LIMITS)
    compiled.warmup(resolve(validate_image_request({"prompt": "x", "seed": 0}, limits), limits, on))
    assert [e[1] for e in compiled.events][:2] == ["mount", "compile"]
    _run(compiled)
    assert compiled.compiles == 1


@pytest.mark.slow
@pytest.mark.parametrize("model, layout", [
    ("tiny-flux2", {"ulysses_degree": 2, "ring_degree": 1}), ("tiny-flux2", {"ulysses_degree": 1, "ring_degree": 2}),
    ("tiny-qwen-image", {"ulysses_degree": 2, "ring_degree": 1}), ("tiny-qwen-image", {"ring_degree": 2}),
    ("tiny-z-image", {"ulysses_degree": 2}), ("tiny-z-image", {"ring_degree": 2})],
    ids=["flux2-ulysses2", "flux2-ring2", "qwen-ulysses2", "qwen-ring2", "z-image-ulysses2", "z-image-ring2"])
def test_two_ranks_equal_one_rank(ray_cluster, model, layout):
    """Prompts of different lengths: Qwen-Image's padded text and Z-Image's padded unified
    sequences are masked across the ranks (Z-Image through our own split hooks, diffusers having
    no split plan for it); under a ring the mask rides in the keys
    (``parallel.attention.masked_usp_attention``)."""
    runner = BatchRunner(model)
    batch = batch_of(params(runner, "a red circle", 3, **guided(runner)),
                     params(runner, "a green star at night on a black background", 4,
                            **{**guided(runner), "negative_prompt": "a very blurry photo"}))
    single = runner.denoise(batch)
    workers = rank_workers(layout, model)
    try:
        sharded = ray.get([w.denoise.remote(batch) for w in workers], timeout=300)[0]
        for a, b in zip(single.images, sharded.images, strict=True):
            assert np.abs(a - b).max() <= 5e-4 and np.abs(a - b).mean() <= 5e-5
        # Cache-DiT through the family's own adapter on the shards: every rank decides the same steps
        cached = batch_of(params(runner, "a red circle", 3, enable_cache_dit=True,
                                 cache_dit_params={"Fn_compute_blocks": 1, "max_warmup_steps": 2,
                                                   "residual_diff_threshold": 0.5}, **guided(runner)))
        out = ray.get([w.denoise.remote(cached) for w in workers], timeout=300)[0]
        assert np.isfinite(out.images[0]).all()
        stats = ray.get([w.cache_stats.remote() for w in workers])
        assert stats[0]["cached_steps"] == stats[1]["cached_steps"]
    finally:
        for w in workers:
            ray.kill(w)


@pytest.mark.slow
@pytest.mark.parametrize("model, layout, reason", [
    ("tiny-z-image", {"ulysses_degree": 1, "ring_degree": 3}, "ulysses_degree x ring_degree must divide it")],
    ids=["z-image-ring3"])
def test_layouts_a_family_cannot_split_are_refused_at_startup(ray_cluster, model, layout, reason):
    """Z-Image's unified sequence is a multiple of 32 tokens: 3 ranks cannot share it evenly."""
    from deployments.rank_worker import RankWorker
    from parallel.groups import free_port

    world_size = layout.get("ulysses_degree", 1) * layout.get("ring_degree", 1)
    workers = [RankWorker.options(num_cpus=0).remote(r, {"name": model}, {}, layout, 1) for r in range(world_size)]
    try:
        port = free_port()
        with pytest.raises(ray.exceptions.RayTaskError, match=reason):
            ray.get([w.join.remote("127.0.0.1", port) for w in workers], timeout=300)
    finally:
        for w in workers:
            ray.kill(w)


@pytest.mark.slow
@pytest.mark.parametrize("config_file", ["tiny-flux2-cpu.yaml", "tiny-qwen-image-cpu.yaml", "tiny-z-image-cpu.yaml"])
def test_served_through_the_openai_sdk(deploy, config_file):
    """Each family's CPU config serves through the OpenAI SDK."""
    import yaml
    from pathlib import Path

    from tests.helpers import openai_client

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / config_file).read_text())
    args = config["applications"][0]["args"]
    args["replica"]["torch_threads"] = 2
    url = deploy(args)
    response = openai_client(url).images.generate(prompt="a red circle", size="64x48",
                                                  extra_body={"seed": 1, "num_inference_steps": 4})
    assert png_pixels(response.data[0].b64_json).shape == (48, 64, 3)
    meta = response.model_extra["ditserve"]
    assert meta["signature"].startswith(f"{args['model']['name']} 64x48 steps=4 ")


def test_a_size_past_the_models_position_table_is_refused_before_the_batch():
    """tiny-z-image's RoPE tables hold 128 latent patches a side (4 pixels each): 4x516 passed the
    contract (within max_pixels) and failed its whole batch with IndexError, a 500. The facts
    carry max_side now and the contract refuses it naming size; the edge runs."""
    import dataclasses

    from pipeline.errors import InvalidRequestError

    runner = BatchRunner("tiny-z-image")
    limits = runner.facts().limits(runner.name, {**LIMITS, "max_pixels": 65536})
    assert limits.max_side == 512
    edge = resolve(validate_image_request({"prompt": "a red circle", "seed": 1, "size": "4x512",
                                           "num_inference_steps": 2, **unguided(runner)}, limits), limits)
    with pytest.raises(IndexError):  # what the batch met
        runner.run(batch_of(dataclasses.replace(edge, height=516)))
    for size in ("4x516", "516x4"):
        with pytest.raises(InvalidRequestError, match="each side must be at most 512 pixels") as err:
            validate_image_request({"prompt": "a", "size": size}, limits)
        assert err.value.param == "size"
    assert png_pixels(runner.run(batch_of(edge))[0].images[0]).shape[:2] == (512, 4)
