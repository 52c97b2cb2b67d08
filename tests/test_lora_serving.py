"""LoRA adapters through real Ray Serve: HTTP (OpenAI client), the handle, /v1/models, adapter
affinity across 2 replicas, a live registry change, an adapter file that breaks at load time."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from openai import BadRequestError, NotFoundError
from PIL import Image
from ray import serve

from compat.ray_serve import deploy_config
from deployments.config import EMBEDDED_LORA_DIR
from tests.helpers import openai_client, pixels, post, wait_until
from tests.helpers import router_stats as stats

pytestmark = pytest.mark.slow

FAST = {"size": "64x64", "num_inference_steps": 2}


@pytest.fixture(scope="module")
def fragile(tmp_path_factory):
    """A valid adapter at a path the test later removes (its file breaks at load time)."""
    path = tmp_path_factory.mktemp("fragile") / "fragile"
    shutil.copytree(EMBEDDED_LORA_DIR / "outline", path)
    return path


@pytest.fixture(scope="module")
def lora_args(fragile):
    return {
        "model": {"loras": {"magenta": {}, "outline": {"default_scale": 0.9}, "fragile": {"path": str(fragile)}},
                  "max_loaded_loras": 1},
        "replica": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}, "torch_threads": 1},
        "batching": {"max_batch_size": 4, "max_wait_ms": 20, "max_affinity_wait_ms": 400,
                     "routing_stats_period_s": 0.2, "max_queued_requests": 64},
    }


@pytest.fixture(scope="module")
def url(deploy, lora_args):
    return deploy(lora_args, fresh=True)


@pytest.fixture(scope="module")
def client(url):
    return openai_client(url)


def _image(client, lora=None, model=None, seed=1, prompt="a red circle on a blue background"):
    extra = {**FAST, "seed": seed, **({"lora": lora} if lora is not None else {})}
    kwargs = {"model": model} if model else {}
    response = client.images.generate(prompt=prompt, response_format="b64_json", extra_body=extra, **kwargs)
    return pixels(response.data[0].b64_json), response.model_extra["ditserve"]


def test_models_lists_the_adapters(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny-flux", "tiny-flux:fragile", "tiny-flux:magenta", "tiny-flux:outline"}
    assert models["tiny-flux:magenta"].model_extra["parent"] == "tiny-flux"


def test_mixed_workload_over_http_and_the_handle(client, url):
    base, _ = _image(client)
    zero, _ = _image(client, lora=[{"name": "magenta", "scale": 0.0}])
    assert np.array_equal(base, zero)
    magenta, meta = _image(client, lora=[{"name": "magenta", "scale": 1.0}])
    assert np.abs(magenta - base).max() > 20 and "lora=magenta:1" in meta["signature"]
    assert meta["acceleration"]["lora"]["active"] == ["magenta:1"]
    by_model, meta = _image(client, model="tiny-flux:magenta")
    assert np.array_equal(by_model, magenta)  # model "<base>:<adapter>" = the adapter at its default scale
    with ThreadPoolExecutor(6) as pool:  # a mixed burst: each answer equals its request run alone
        jobs = [pool.submit(_image, client, lora, None, 1) for lora in
                ([{"name": "magenta", "scale": 1.0}], None, [{"name": "magenta", "scale": 0.0}]) * 2]
        outs = [job.result() for job in jobs]
    for (image, _), expected in zip(outs, (magenta, base, base) * 2, strict=True):
        assert np.abs(image.astype(int) - expected).max() <= 1
    handle = serve.get_app_handle("ditserve")
    result = handle.generate.remote({"prompt": "a red circle on a blue background", "seed": 1, **FAST,
                                     "lora": [{"name": "magenta", "scale": 1.0}]}).result()
    assert np.abs(pixels(result.data[0].b64_json).astype(int) - magenta).max() <= 1
    with pytest.raises(NotFoundError, match="LoRA adapter 'nope' is not registered"):
        _image(client, lora=[{"name": "nope"}])
    response = post(url, {"prompt": "a", "lora": [{"name": "../x"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora"
    _image(client, lora=[{"name": "magenta", "scale": 0.5}])  # another scale: magenta found loaded (a hit)
    def counters() -> dict[str, int]:  # replicas report every routing_stats_period_s: they trail answers
        total = {"lora_loads": 0, "lora_hits": 0, "lora_evictions": 0}
        for replica in stats(url)["replicas"].values():
            for key in total:
                total[key] += replica.get(key, 0)
        return total

    wait_until(lambda: counters()["lora_loads"] >= 1 and counters()["lora_hits"] >= 1, timeout=30)


def test_affinity_prefers_the_replica_holding_the_adapter(client, url):
    """Each replica keeps one adapter loaded (``max_loaded_loras: 1``); so far none has loaded
    ``outline``. Once one has, every new signature using it (another scale: no replica holds that
    state) goes to that replica, a cheap switch rather than a load from disk."""
    _, first = _image(client, lora=[{"name": "outline", "scale": 0.3}], seed=2)
    rid = first["replica"]

    def replica():
        return stats(url)["replicas"][rid]

    wait_until(lambda: "outline" in (replica().get("loras_loaded") or ()))
    loads, batches = replica()["lora_loads"], replica()["batches"]
    for scale in (0.4, 0.5, 0.6):
        _, meta = _image(client, lora=[{"name": "outline", "scale": scale}], seed=2)
        assert meta["replica"] == rid and meta["state_change"] and meta["acceleration"]["lora"]["loads"] == 0
    wait_until(lambda: replica()["batches"] >= batches + 3)
    assert replica()["lora_loads"] == loads  # switched from the LRU: no load from disk


def test_adapter_file_broken_at_load_time_fails_its_batch_only(client, url, fragile):
    shutil.rmtree(fragile)
    response = post(url, {"prompt": "a red circle", "seed": 1, **FAST, "lora": [{"name": "fragile"}]})
    error = response.json()["error"]
    assert response.status_code == 500 and error["code"] == "lora_load_failed" and "'fragile'" in error["message"]
    assert str(fragile) not in error["message"] and error["param"] == "lora"
    # named by model, the error names model (helper-79: it named lora, a field the request had not given)
    error = post(url, {"prompt": "a red circle", "seed": 1, **FAST, "model": "tiny-flux:fragile"}).json()["error"]
    assert (error["code"], error["param"]) == ("lora_load_failed", "model"), error
    image, _ = _image(client)  # the replica keeps serving
    assert image.shape == (64, 64, 3)


def test_edits_take_adapters_sent_as_form_fields_by_the_sdk_and_the_cli(client, url, tmp_path, capsys):
    """``images.edit`` is always multipart: the SDK's ``lora[][name]``/``lora[][scale]`` fields
    were a 400 ("[] only at the end"), so neither the SDK nor ``ditserve edit --lora`` could
    apply an adapter to an edit. (outline at scale 0: a second item, left out of the set.)"""
    from deployments.cli import main

    source, out = tmp_path / "in.png", tmp_path / "out.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(source)
    fields = {"num_inference_steps": 4, "seed": 2, "strength": 1.0}
    loras = [{"name": "magenta", "scale": 0.8}, {"name": "outline", "scale": 0}]

    def edit(lora=None):
        extra = {**fields, **({"lora": lora} if lora else {})}
        response = client.images.edit(image=("in.png", source.read_bytes()), prompt="a red circle",
                                      response_format="b64_json", extra_body=extra)
        return pixels(response.data[0].b64_json), response.model_extra["ditserve"]

    base, _ = edit()
    adapted, meta = edit(loras)
    assert "lora=magenta:0.8" in meta["signature"] and meta["acceleration"]["lora"]["active"] == ["magenta:0.8"]
    assert np.abs(adapted - base).max() > 0
    result = serve.get_app_handle("ditserve").edit.remote({"prompt": "a red circle", "image": source.read_bytes(),
                                                           **fields, "lora": loras}).result()
    assert np.abs(pixels(result.data[0].b64_json) - adapted).max() <= 1  # as the handle's list
    with pytest.raises(BadRequestError) as info:  # {a}, {b, 0.5} and {a, 0.5}, {b}: one form, refused
        edit([{"name": "magenta"}, {"name": "outline", "scale": 0.5}])
    assert info.value.param == "lora" and "same fields" in info.value.message
    assert main(["edit", str(source), "a red circle", "-o", str(out), "--url", url, "--steps", "4", "--seed", "2",
                 "--strength", "1", "--lora", "magenta:0.8", "--lora", "outline:0"]) == 0, capsys.readouterr().err
    assert np.abs(pixels(out.read_bytes()) - adapted).max() <= 1
    assert main(["edit", str(source), "a red circle", "-o", str(out), "--url", url, "--steps", "4", "--seed", "2",
                 "--strength", "1", "--lora", "magenta", "--lora", "outline:0.5"]) == 0  # JSON text: not ambiguous
    assert "lora=magenta:1 lora=outline:0.5" in capsys.readouterr().out


def _deploy_file(args: dict, user_configs: dict[str, dict] | None = None,
                 options: dict[str, dict] | None = None) -> None:
    """Deploy as a Serve config file is deployed (serve deploy / RayService), with
    ``user_configs`` (deployment name -> user_config) and ``options`` (deployment name -> other
    options, e.g. ``num_replicas``) in its ``deployments`` section."""
    from ray.serve.schema import ServeDeploySchema

    names = [*(user_configs or {}), *(name for name in options or {} if name not in (user_configs or {}))]
    deployments = [{"name": name, **({"user_config": user_configs[name]} if name in (user_configs or {}) else {}),
                    **(options or {}).get(name, {})} for name in names]
    deploy_config(ServeDeploySchema.model_validate({"applications": [
        {"name": "ditserve", "route_prefix": "/", "import_path": "deployments.app:build_app", "args": args,
         **({"deployments": deployments} if deployments else {})}]}), wait_running=False)
    wait_until(lambda: serve.status().applications["ditserve"].status == "RUNNING", timeout=120)


def test_a_live_registry_change_adds_an_adapter_without_a_restart(url, lora_args, tmp_path):
    args = {**lora_args, "model": {**lora_args["model"], "loras": {"magenta": {}}}}
    serve.delete("ditserve")
    try:
        _deploy_file(args)
        before = set(stats(url)["replicas"])
        loras = {"magenta": {}, "late": {"path": str(EMBEDDED_LORA_DIR / "outline")}}
        _deploy_file(args, {"DiTReplica": {"loras": loras}, "Ingress": {"acceleration": {}, "loras": loras}})
        wait_until(lambda: "tiny-flux:late" in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]},
                   timeout=60)
        response = post(url, {"prompt": "a red circle", "seed": 1, **FAST, "lora": [{"name": "late"}]})
        assert response.status_code == 200, response.text
        assert set(stats(url)["replicas"]) == before  # the same replicas: nothing restarted

        # Updates a running replica cannot apply are refused, the settings in force kept: they
        # stopped the replica (Serve: DEPLOY_FAILED, none left) and every request failed
        bad_file = tmp_path / "bad.safetensors"
        bad_file.write_text("not an adapter")
        bad = {**loras, "bad": {"path": str(bad_file)}}
        _deploy_file(args, {"DiTReplica": {"loras": bad},
                            "Ingress": {"acceleration": {"cfg_gate_step": 7, "attention_backend": "nonsense"},
                                        "loras": bad},  # refused whole: its registry stays too
                            "Router": {**args.get("batching", {}), "max_batch_size": 0}})
        app = lambda: serve.get_app_handle("ditserve").stats.remote().result()  # noqa: E731
        wait_until(lambda: app()["ingress"]["live_update_refused"] is not None and
                   app()["router"]["live_update_refused"] is not None and
                   any(r.get("live_update_refused") for r in stats(url)["replicas"].values()), timeout=60)
        assert "cfg_gate_step" in app()["ingress"]["live_update_refused"]["error"]
        assert "max_batch_size" in app()["router"]["live_update_refused"]["error"]
        assert "model.loras.bad" in next(r["live_update_refused"]["error"] for r in stats(url)["replicas"].values())
        assert serve.status().applications["ditserve"].status == "RUNNING"
        assert set(stats(url)["replicas"]) == before
        plain = post(url, {"prompt": "a red circle", "seed": 1, **FAST})  # the defaults in force: no override
        assert plain.status_code == 200 and "cfg_gate_step=off" in plain.json()["ditserve"]["signature"]
        assert stats(url)["max_batch_size"] == args.get("batching", {}).get("max_batch_size", 8)
        assert post(url, {"prompt": "a red circle", "seed": 1, **FAST, "lora": [{"name": "late"}]}).status_code == 200
        assert post(url, {"prompt": "a red circle", "seed": 1, **FAST, "lora": [{"name": "bad"}]}).status_code == 404
        # the Ingress (which cannot load adapters) takes the registry, the DiTReplica refused "bad"
        _deploy_file(args, {"DiTReplica": {"loras": bad}, "Ingress": {"acceleration": {}, "loras": bad}})
        wait_until(lambda: app()["ingress"]["live_update_refused"] is None, timeout=60)
        refused = post(url, {"prompt": "a red circle", "seed": 1, **FAST, "lora": [{"name": "bad"}]})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "adapter_refused" and "'bad'" in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == "lora"  # the field, as lora_load_failed names it
        by_model = post(url, {"prompt": "a red circle", "seed": 1, **FAST, "model": "tiny-flux:bad"}).json()["error"]
        assert (by_model["code"], by_model["param"]) == ("adapter_refused", "model"), by_model  # helper-79
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        # Refused by every replica (their routing stats say so): /v1/models leaves it out (it
        # listed it) and the Router refuses its requests at admission, before they queue
        models = lambda: {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}  # noqa: E731
        wait_until(lambda: "tiny-flux:bad" not in models(), timeout=60)
        assert {"tiny-flux:late", "tiny-flux:magenta"} <= models()
        refused = post(url, {"prompt": "a red circle", "seed": 1, **FAST, "lora": [{"name": "bad"}]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "adapter_refused", refused.text
        assert refused.json()["error"]["param"] == "lora" and "every replica" in refused.json()["error"]["message"]
        by_model = post(url, {"prompt": "a red circle", "seed": 1, **FAST, "model": "tiny-flux:bad"}).json()["error"]
        assert (by_model["code"], by_model["param"]) == ("adapter_refused", "model"), by_model
        assert stats(url)["counters"]["rejected_adapter_refused"] >= 1
        # The file fixed, a replica that starts now (scaling up, a replacement) takes it: batches
        # naming it go there, not to the replicas that refused it (each answered 400 on its turn)
        shutil.copy(EMBEDDED_LORA_DIR / "outline" / "pytorch_lora_weights.safetensors", bad_file)
        _deploy_file(args, {"DiTReplica": {"loras": bad}, "Ingress": {"acceleration": {}, "loras": bad}},
                     {"DiTReplica": {"num_replicas": 3}})
        wait_until(lambda: len(stats(url)["replicas"]) == 3 and
                   all("loras_refused" in r for r in stats(url)["replicas"].values()), timeout=120)
        replicas = stats(url)["replicas"]
        assert {rid for rid, r in replicas.items() if r["loras_refused"] == ["bad"]} == before
        (taker,) = set(replicas) - before
        for seed in range(4):
            response = post(url, {"prompt": "a red circle", "seed": seed, **FAST, "lora": [{"name": "bad"}]})
            assert response.status_code == 200, response.text
            assert response.json()["ditserve"]["replica"] == taker
        assert "tiny-flux:bad" in models()  # one replica takes it: listed again
        _deploy_file(args, {"DiTReplica": {"loras": loras}, "Ingress": {"acceleration": {}, "loras": loras}})
        wait_until(lambda: not any(r.get("live_update_refused") for r in stats(url)["replicas"].values()),
                   timeout=60)  # a good update applies
        wait_until(lambda: app()["router"]["live_update_refused"] is None, timeout=60)  # args' knobs again
    finally:
        serve.delete("ditserve")  # the next module deploys afresh
