"""Helpers the tests share (test files never import from each other)."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
from PIL import Image

from pipeline.contract.limits import ServingLimits
from pipeline.contract.videos import VideoGenerationRequest
from pipeline.modes import GuidanceMode
from pipeline.sampling import SamplingParams, resolve_video
from pipeline.signature import BatchSignature
from pipeline.wire import Batch

# The app most HTTP tests share: tiny-flux, one replica with 2 torch threads.
TINY_ARGS = {"replica": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 2}, "torch_threads": 2}}


def flux_params(prompt, seed, *, negative=None, true_cfg_scale=1.0, n=1, steps=6, size=(64, 48), guidance=3.5,
                **fields) -> SamplingParams:
    """A resolved tiny-flux request with diffusers' true-CFG rule (CFG when the scale is > 1 and
    a negative prompt is given); ``fields`` override any other SamplingParams field."""
    guided = true_cfg_scale > 1 and negative is not None
    return SamplingParams(
        request_id=f"r{seed}", model="tiny-flux", prompt=prompt, negative_prompt=negative if guided else None, n=n,
        width=size[0], height=size[1], num_frames=1, num_inference_steps=steps,
        guidance_mode=GuidanceMode.TRUE_CFG if guided else GuidanceMode.NONE,
        cfg_scale=true_cfg_scale if guided else 1.0, embedded_guidance_scale=guidance, seed=seed,
        enable_cache_dit=False, cache_dit_params=None, cfg_gate_fraction=1.0, attention_backend=None,
        response_format="b64_json", **fields)


def wan_limits(family, name: str = "tiny-wan") -> ServingLimits:
    """Limits of a tiny Wan family: 64x48, 6 steps, guidance 5.0, 9 frames by default."""
    return ServingLimits(name, family.spatial_factor, 64, 48, 6, 5.0, guidance_embeds=False,
                         guidance_style=family.guidance_style, dual_mode=family.dual_mode,
                         temporal_factor=family.temporal_factor, default_num_frames=9, max_frames=33,
                         default_boundary_ratio=family.boundary_ratio)


def video_params(family, prompt, seed, **fields) -> SamplingParams:
    """A validated, resolved video request body on a tiny Wan family."""
    limits = wan_limits(family)
    request = VideoGenerationRequest.model_validate({"prompt": prompt, "seed": seed, **fields},
                                                    context={"limits": limits})
    return resolve_video(request, limits, request_id=f"v{seed}")


def rank_workers(layout: dict, model: str | dict = "tiny-flux", acceleration: dict | None = None) -> list:
    """The rank actors of a multi-rank replica with ``layout`` (``parallel`` fields), joined into
    one process group on this node (1 torch thread each); rank 0 is ``workers[0]``. ``model``: a
    name or a ``model`` section. The caller kills them."""
    import ray

    from deployments.rank_worker import RankWorker
    from parallel.config import ParallelConfig
    from parallel.groups import free_port

    model = {"name": model} if isinstance(model, str) else model
    workers = [RankWorker.options(num_cpus=0).remote(r, model, acceleration or {}, layout, 1)
               for r in range(ParallelConfig.of(layout).world_size)]
    port = free_port()
    ray.get([w.join.remote("127.0.0.1", port) for w in workers], timeout=300)
    return workers


def batch_of(*params: SamplingParams, batch_id: str = "b") -> Batch:
    return Batch(batch_id, BatchSignature.of(params[0]), tuple(params))


def openai_client(url: str):
    """The OpenAI client the HTTP tests use against ``url`` (no retries, 120 s timeout)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def pixels(png: bytes | str) -> np.ndarray:
    """A PNG (bytes or base64 text) as an (H, W, 3) int16 array, for differences."""
    data = base64.b64decode(png) if isinstance(png, str) else png
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json=body, timeout=timeout)


def router_stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=30).json()["router"]


def batches_running(url: str, batches: int) -> bool:
    """Whether ``batches`` batches are in flight and every one has begun on its replica (one
    read of the Router's stats)."""
    now = router_stats(url)
    return now["inflight_batches"] == batches and now["unstarted_batches"] == 0


def step_ms(run, steps: int) -> float:
    """Milliseconds per denoising step: ``run(steps)`` (a batch of ``steps`` steps, returning
    its ``timings_ms["denoise"]``) run twice, the faster taken (a fresh replica's first batch
    runs slower). Sizes the batches a test needs to last some seconds on any machine."""
    return min(run(steps), run(steps)) / steps


def steps_lasting(seconds: float, per_step_ms: float, lo: int, hi: int) -> int:
    """The steps of a batch lasting ``seconds`` at ``per_step_ms``, within [``lo``, ``hi``]."""
    return max(lo, min(hi, round(seconds * 1000.0 / per_step_ms)))


def serve_replica_actor(deployment: str):
    """The actor of ``deployment``'s (one) Serve replica, e.g. ``"Router"``, to kill."""
    import ray

    [actor] = [a for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::") and f"#{deployment}#" in a["name"]]
    return ray.get_actor(actor["name"], namespace=actor["namespace"])


def post_until_ok(url: str, body: dict, allowed: tuple[int, ...], timeout: float = 120.0) -> httpx.Response:
    """Post ``body`` every 0.5 s until it is answered 200 (a part being replaced meanwhile);
    any status not in ``allowed``, or no 200 within ``timeout`` s, is an ``AssertionError``."""
    deadline = time.monotonic() + timeout
    while (r := post(url, body)).status_code != 200:
        assert r.status_code in allowed and time.monotonic() < deadline, r.text
        time.sleep(0.5)
    return r


def wait_until(predicate, timeout: float = 30.0) -> None:
    """Poll ``predicate`` every 50 ms; raise ``AssertionError`` if it is not true within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def metrics_samples(prefix: str, timeout: float = 60.0, until=None) -> list[str]:
    """The Prometheus samples (lines) whose name starts with ``prefix`` in this driver's Ray node's
    metrics export (``ray.init``'s node), read until ``until(samples)`` holds (default: any sample)
    or ``timeout`` s pass (Ray exports every ``metrics_report_interval_ms``, 10 s by default).
    Returns the last read."""
    import httpx
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port  # Ray's own node record (no public API)
    until = until or bool
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        samples = [line for line in text.splitlines() if line.startswith(prefix)]
        if until(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(1.0)
