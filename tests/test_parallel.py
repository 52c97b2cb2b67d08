"""Sequence parallelism on CPU: real Ray actors, gloo, yunchang, diffusers' sharding hooks."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import time

import httpx
import numpy as np
import pytest
import ray
import torch
from PIL import Image
from ray import serve

from deployments.rank_worker import RankWorker, layout_problems_before_loading, rank_device
from parallel.attention import lse_math_attention
from parallel.config import ParallelConfig
from parallel.groups import free_port
from pipeline.cache_dit_params import CacheDiTParams
from pipeline.runner import BatchRunner
from tests.helpers import batch_of, batches_running, rank_workers, serve_replica_actor, wait_until
from tests.helpers import flux_params as params
from tests.helpers import video_params


def test_layout_checks():
    assert ParallelConfig(3, 1).startup_problems(num_heads=4) == [
        "the model has 4 attention heads, not divisible by parallel.ulysses_degree=3"]
    assert "2 placement-group bundles" in ParallelConfig(2, 2).startup_problems(num_heads=4, bundles=2)[0]
    assert ParallelConfig(2, 2).split_problems({"image tokens": 70, "text tokens": 32}) == [
        "image tokens has 70 tokens, not divisible by the 4 sequence-parallel ranks"]


def test_the_checkpoint_config_rules_out_a_layout_before_any_rank_loads(tmp_path, monkeypatch):
    """The heads come from ``transformer/config.json`` under either diffusers key (Z-Image's
    ``n_heads``); a checkpoint whose config says nothing defers to the check after loading. A hub
    id is read from its snapshot in the node's Hugging Face cache (it read nothing before)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert layout_problems_before_loading({"name": "tiny-flux"}, ParallelConfig(3, 1)) == [
        "the model has 4 attention heads, not divisible by parallel.ulysses_degree=3"]
    assert layout_problems_before_loading({"name": "tiny-flux"}, ParallelConfig(2, 1)) == []
    assert layout_problems_before_loading({"name": "tiny-z-image"}, ParallelConfig(3, 1)) == [
        "the model has 4 attention heads, not divisible by parallel.ulysses_degree=3"]
    (tmp_path / "model_index.json").write_text("{}")
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text('{"_class_name": "SomeTransformer"}')
    assert layout_problems_before_loading({"name": "custom", "path": str(tmp_path)}, ParallelConfig(3, 1)) == []
    assert layout_problems_before_loading({"name": "hub", "path": "org/model-id"}, ParallelConfig(3, 1)) == []
    snapshot = tmp_path / "hub" / "models--org--model-id" / "snapshots" / "0123abcd"  # huggingface_hub's layout
    (snapshot / "transformer").mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    (snapshot / "model_index.json").write_text("{}")
    (snapshot / "transformer" / "config.json").write_text('{"num_attention_heads": 4}')
    assert layout_problems_before_loading({"name": "hub", "path": "org/model-id"}, ParallelConfig(3, 1)) == [
        "the model has 4 attention heads, not divisible by parallel.ulysses_degree=3"]
    (tmp_path / "transformer" / "config.json").write_text('{"num_attention_heads": 4,')  # unreadable
    assert layout_problems_before_loading({"name": "custom", "path": str(tmp_path)}, ParallelConfig(3, 1)) == []
    (tmp_path / "transformer" / "config.json").write_text('{"num_attention_heads": 4}')
    assert layout_problems_before_loading({"name": "custom", "path": str(tmp_path)}, ParallelConfig(3, 1))
    (tmp_path / "model_index.json").unlink()  # not a diffusers directory: loading says so, not this check
    assert layout_problems_before_loading({"name": "custom", "path": str(tmp_path)}, ParallelConfig(3, 1)) == []
    from pipeline.tiny.registry import TRAINED_TINY_FLUX

    assert layout_problems_before_loading({"name": "mine", "path": str(TRAINED_TINY_FLUX)}, ParallelConfig(3, 1)) == [
        "the model has 4 attention heads, not divisible by parallel.ulysses_degree=3"]


def test_a_rank_runs_on_the_gpu_ray_gave_it():
    """Ray narrows CUDA_VISIBLE_DEVICES to the rank's GPU (index 0), unless
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES is set: then the rank must use the id Ray
    assigned, or every rank would land on GPU 0."""
    assert rank_device("cuda", ["3"], cuda_visible_set_by_ray=True) == "cuda:0"
    assert rank_device("cuda", ["3"], cuda_visible_set_by_ray=False) == "cuda:3"
    assert rank_device("cuda", [], cuda_visible_set_by_ray=False) == "cuda"  # no GPU from Ray: as configured
    assert rank_device("cpu", ["1"], cuda_visible_set_by_ray=False) == "cpu"


def test_lse_kernel_is_exact_attention_with_its_log_sum_exp():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 10, 3, 8) for _ in range(3))
    out, lse = lse_math_attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-6)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 8 ** -0.5
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-6)


def _denoise(workers, batch):
    outs = ray.get([w.denoise.remote(batch) for w in workers], timeout=300)
    return outs[0]  # rank 0's LoopOutput


CFG = dict(negative="blurry", true_cfg_scale=3.0, size=(64, 64), steps=6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"ulysses_degree": 2, "ring_degree": 1}, {"ulysses_degree": 1, "ring_degree": 2}],
                         ids=["ulysses2", "ring2"])
def test_two_ranks_equal_one_rank(ray_cluster, layout):
    batch_params = (params("a red circle", 3, **CFG), params("a green star at night", 4, **CFG))
    batch = batch_of(*batch_params)
    single = BatchRunner("tiny-flux").denoise(batch)
    workers = rank_workers(layout)
    try:
        sharded = _denoise(workers, batch)
        for a, b in zip(single.images, sharded.images, strict=True):
            assert np.abs(a - b).max() <= 1e-4
    finally:
        for w in workers:
            ray.kill(w)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"ulysses_degree": 2, "ring_degree": 1}, {"ulysses_degree": 1, "ring_degree": 2}],
                         ids=["ulysses2", "ring2"])
def test_two_rank_wan_with_boundary_experts_equals_one_rank(ray_cluster, layout):
    """Both experts of tiny Wan 2.2 run sharded (yunchang self-attention, local cross-attention)."""
    runner = BatchRunner("tiny-wan-moe")
    fields = dict(guidance_scale=4.0, negative_prompt="blurry", num_inference_steps=6, size="64x64")
    batch_params = (video_params(runner.family, "a red circle", 3, **fields),
                    video_params(runner.family, "a green star at night", 4, **fields))
    batch = batch_of(*batch_params)
    single = runner.denoise(batch)
    assert set(single.calls) == {"transformer", "transformer_2"}
    workers = rank_workers(layout, model="tiny-wan-moe")
    try:
        sharded = _denoise(workers, batch)
        assert sharded.calls == single.calls
        for a, b in zip(single.images, sharded.images, strict=True):
            assert a.shape == (1, 9, 64, 64, 3) and np.abs(a - b).max() <= 1e-4
    finally:
        for w in workers:
            ray.kill(w)


@pytest.mark.slow
def test_rendezvous_waits_only_as_configured_after_loading(ray_cluster):
    """A rank loads first (``ready`` answers once its model is loaded, with its weight bytes),
    then joins; the rendezvous gives up after the configured ``rendezvous_timeout_s`` when a
    peer never comes, with an error rather than a hang."""
    worker = RankWorker.options(num_cpus=0).remote(1, {"name": "tiny-flux"}, {}, {"ulysses_degree": 2}, 1)
    try:
        assert ray.get(worker.ready.remote(), timeout=120) > 0
        # given up after its 3 s: with the 600 s default, ray.get would raise GetTimeoutError instead
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(worker.join.remote("127.0.0.1", free_port(), 3.0), timeout=120)
        assert "timeout" in str(info.value).lower() or "timed out" in str(info.value).lower()
    finally:
        ray.kill(worker)


@pytest.mark.slow
def test_cache_dit_decides_the_same_steps_on_every_rank(ray_cluster):
    """Each rank sees different tokens, so its local residual statistic differs; cache-dit
    reduces it over the group. With a threshold inside the range of the statistics some
    steps cache and others do not: both ranks must agree on every one (else all-to-all hangs)."""
    workers = rank_workers({"ulysses_degree": 2, "ring_degree": 1})
    try:
        p = params("a red circle", 3, size=(64, 64), steps=12)
        key = CacheDiTParams(Fn_compute_blocks=1, max_warmup_steps=2, residual_diff_threshold=0.99)  # < 1: measured
        probe_p = dataclasses.replace(p, enable_cache_dit=True, cache_dit_params=key)
        ray.get([w.denoise.remote(batch_of(probe_p)) for w in workers])
        diffs = ray.get([w.cache_stats.remote() for w in workers])
        assert diffs[0]["residual_diffs"] == diffs[1]["residual_diffs"]  # reduced statistic
        values = sorted(diffs[0]["residual_diffs"].values())
        partial = []
        for q in (0.5, 0.75, 0.9, 1.0):  # thresholds inside the statistics' range
            threshold = values[min(int(q * len(values)), len(values) - 1)] * (1.001 if q == 1.0 else 1.0)
            key = CacheDiTParams(Fn_compute_blocks=1, max_warmup_steps=2, residual_diff_threshold=threshold)
            run_p = dataclasses.replace(p, enable_cache_dit=True, cache_dit_params=key)
            ray.get([w.denoise.remote(batch_of(run_p)) for w in workers], timeout=300)
            stats = ray.get([w.cache_stats.remote() for w in workers])
            assert stats[0]["cached_steps"] == stats[1]["cached_steps"]  # and no hang
            assert stats[0]["residual_diffs"] == stats[1]["residual_diffs"]
            if 0 < len(stats[0]["cached_steps"]) < 12 - 2:
                partial.append(threshold)
        assert partial, f"no threshold in {values} split the steps into cached and computed"
    finally:
        for w in workers:
            ray.kill(w)


SP2 = {"parallel": {"ulysses_degree": 2}, "replica": {"torch_threads": 1},
       "limits": {"max_pixels": 256 * 256}}


def _png(r) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))), dtype=np.int16)


@pytest.mark.slow
def test_sp_replica_serves_and_rejects_up_front(deploy):
    body = {"prompt": "a red circle", "seed": 3, "num_inference_steps": 4}
    url = deploy({"replica": {"torch_threads": 1}})
    one = _png(httpx.post(f"{url}/v1/images/generations", json=body, timeout=120))
    url = deploy({**SP2, "parallel": {"ring_degree": 2}})
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["ditserve"]["world_size"] == 2
    assert np.abs(_png(r) - one).max() <= 1  # same image, up to PNG rounding
    # rank 1 loads the transformer alone: rank 0 encodes, broadcasts the embeddings and decodes
    (replica,) = httpx.get(f"{url}/v1/stats").json()["router"]["replicas"].values()
    rank0, rank1 = replica["parameter_bytes_per_rank"]
    assert 0 < rank1 < rank0
    before = httpx.get(f"{url}/v1/stats").json()["router"]["counters"]
    r = httpx.post(f"{url}/v1/images/generations", json={**body, "attention_backend_override": "torch_math"})
    assert r.status_code == 400 and "ring_degree=2" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/images/generations", json={**body, "size": "72x56"})  # 9 x 7 = 63 tokens
    assert r.status_code == 400 and "cannot be split" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/stats").json()["router"]["counters"] == before  # no batch, rejection or failure


@pytest.mark.slow
def test_bad_topology_fails_at_startup(ray_cluster):
    """The layout the model cannot split fails the replica's start; with
    ``max_constructor_retry_count: 1`` Serve gives up after that one start (three by default)."""
    from deployments.app import build_app

    args = {"parallel": {"ulysses_degree": 3}, "replica": {"torch_threads": 1, "max_constructor_retry_count": 1}}
    with pytest.raises(RuntimeError, match="Deploying application bad-topology failed"):
        serve.run(build_app(args), name="bad-topology", route_prefix="/bad")
    status = serve.status().applications["bad-topology"].deployments["DiTReplica"]
    assert "the model has 4 attention heads, not divisible by parallel.ulysses_degree=3" in status.message
    assert "failed to start 1 times in a row" in status.message, status.message
    serve.delete("bad-topology")


CFG2 = {**SP2, "parallel": {"cfg_degree": 2}}
SHARDED = {**SP2, "parallel": {"ulysses_degree": 2, "shard_weights": True}}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [SP2, CFG2, SHARDED], ids=["ulysses2", "cfg2", "sharded"])
def test_killed_rank_fails_its_batch_and_the_replica_is_replaced(deploy, layout):
    """A rank killed after its batch passed a step boundary fails that batch (an ``error`` event
    naming the request; not requeued: some of it ran), and Serve replaces the replica. The kill
    waits for the first preview (step 25 of 100): after a fixed 0.5 s the sharded layout in CI had
    not finished its first step, so the batch was rightly requeued and answered 200. (The 500 of a
    request that is not streamed: test_faults' fault on one rank.)"""
    url = deploy(layout, fresh=True)
    wait_until(lambda: len(httpx.get(f"{url}/v1/stats").json()["router"]["replicas"]) == 1, timeout=60)
    (first,) = httpx.get(f"{url}/v1/stats").json()["router"]["replicas"]
    # guided: both CFG groups busy
    slow = {"prompt": "slow", "seed": 1, "num_inference_steps": 100, "size": "256x256", "negative_prompt": "blurry",
            "true_cfg_scale": 2.0, "stream": True, "partial_images": 3}
    with httpx.Client(timeout=300) as client:
        with client.stream("POST", f"{url}/v1/images/generations", json=slow) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            previewed = False
            for line in lines:
                if line.startswith("event: image_generation.partial_image"):
                    previewed = True
                    break  # a step boundary passed
            assert previewed, "the stream ended before its first preview"
            ranks = [a for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith("ditserve-") and a["name"].endswith("-rank1")]
            assert ranks
            ray.kill(ray.get_actor(ranks[0]["name"], namespace=ranks[0]["namespace"]))
            events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
        error = events[-1]
        assert error["type"] == "error" and error["error"]["type"] == "server_error", events[-1]
        assert "request img-" in error["error"]["message"], error
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            r = client.post(f"{url}/v1/images/generations", json={"prompt": "after", "seed": 2,
                                                                   "num_inference_steps": 2})
            if r.status_code == 200:
                break
            time.sleep(2)
        assert r.status_code == 200 and r.json()["ditserve"]["world_size"] == 2
        assert r.json()["ditserve"]["replica"] != first  # replaced (helper-71: was not checked)


@pytest.mark.slow
def test_a_rank_killed_while_its_replica_idles_costs_the_next_batch_nothing(deploy):
    """A rank actor killed between batches: the next batch finds the group broken before any
    step ran, so the replica refuses it (and exits) and the Router requeues it to the
    replacement; the request is answered 200 (it was 500 'batch failed')."""
    # The next batch, not a health check, must find the dead rank (in CI a check replaced the
    # replica first, and the request went to the new one without a requeue). Serve checks a
    # replica as it starts and then every 0.9-1.1 x health_check_period_s: with 20 s, the first
    # check after the start comes >= 18 s after it, while this test kills the rank and sends
    # the batch within ~2 s of the deploy. That check then finds the replica gone and Serve
    # starts the replacement the requeued batch waits for (with 60 s the test took 66 s).
    url = deploy({**SP2, "replica": {**SP2["replica"], "health_check_period_s": 20.0}}, fresh=True)
    first = post_ok(url, {"prompt": "before", "seed": 1, "num_inference_steps": 2})
    ranks = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("ditserve-") and a["name"].endswith("-rank1")]
    assert len(ranks) == 1
    ray.kill(ray.get_actor(ranks[0]["name"], namespace=ranks[0]["namespace"]))
    time.sleep(1.0)  # the actor is gone before the next batch is sent
    r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "after", "seed": 2, "num_inference_steps": 2},
                   timeout=300)
    assert r.status_code == 200, r.text
    meta = r.json()["ditserve"]
    assert meta["world_size"] == 2 and meta["replica"] != first["ditserve"]["replica"]
    stats = httpx.get(f"{url}/v1/stats", timeout=60).json()["router"]
    assert stats["counters"].get("requeued", 0) >= 1 and stats["counters"].get("failed_batches", 0) == 0


def test_a_rank_killed_while_no_batch_comes_is_found_by_a_health_check(deploy):
    """A rank actor killed while its replica idles and no batch comes: the replica's next
    health check finds the rank dead, and the replica breaks and exits on its own (Serve's
    next check replaces it), rather than failing checks until Serve kills it after the third
    in a row. The old replica's death cause tells the two apart: a worker that exited, not
    ``ray.kill``."""
    url = deploy(SP2, fresh=True)  # health checks every 2 s (the product's default)
    first = post_ok(url, {"prompt": "before", "seed": 1, "num_inference_steps": 2})
    replica = serve_replica_actor("DiTReplica")
    [rank] = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith("ditserve-") and a["name"].endswith("-rank1")]
    ray.kill(ray.get_actor(rank["name"], namespace=rank["namespace"]))
    died = {}

    def replica_dead() -> bool:
        try:
            ray.get(replica.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.ActorDiedError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        return False

    wait_until(replica_dead, timeout=120)
    try:  # a call made after the death reads its recorded cause (one in flight at it may not)
        ray.get(replica.__ray_ready__.remote(), timeout=30)
    except ray.exceptions.ActorDiedError as exc:
        died["error"] = str(exc)
    assert "ray.kill" not in died["error"] and "worker process has died" in died["error"], died["error"]
    after = post_ok(url, {"prompt": "after", "seed": 2, "num_inference_steps": 2})
    assert after["ditserve"]["world_size"] == 2 and after["ditserve"]["replica"] != first["ditserve"]["replica"]


def post_ok(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()
