"""KubeRay manifests: generated from configs/ without drift, valid against KubeRay's RayService
schema and Ray Serve's ServeDeploySchema, GPUs adding up."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "tests" / "data" / "rayservice_v1.json").read_text())
MANIFESTS = sorted((ROOT / "k8s").glob("*.rayservice.yaml"))


def _generate():
    import importlib.util

    spec = importlib.util.spec_from_file_location("k8s_generate", ROOT / "k8s" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_has_a_manifest_and_none_drifted():
    generate = _generate()
    assert {p.name for p in MANIFESTS} == {f"{c.removesuffix('.yaml')}.rayservice.yaml" for c in generate.MANIFESTS}
    for config_file in generate.MANIFESTS:
        path = ROOT / "k8s" / f"{config_file.removesuffix('.yaml')}.rayservice.yaml"
        assert path.read_text() == generate.render(config_file), f"{path.name} drifted: run k8s/generate.py"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_a_valid_rayservice(path):
    manifest = yaml.safe_load(path.read_text())
    errors = list(jsonschema.Draft7Validator(SCHEMA).iter_errors(manifest))
    assert not errors, [e.message for e in errors]
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    app = next(a for a in serve_config["applications"] if a["import_path"] == "deployments.app:build_app")
    AppConfig.model_validate(app["args"])
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    per_replica = _generate().gpus_per_replica(app["args"])
    fewest, most = _generate().replica_range(app["args"])  # num_replicas, or autoscaling's min..max
    worker_gpus = {bound: sum(int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) * g[bound]
                              for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"])
                   for bound in ("minReplicas", "maxReplicas")}
    assert per_replica * most <= worker_gpus["maxReplicas"] or per_replica == 0
    if app["args"].get("replica", {}).get("autoscaling"):
        # Serve adds replicas up to max_replicas; Ray's autoscaler must be able to add their pods.
        assert cluster.get("enableInTreeAutoscaling") is True
        assert per_replica * fewest <= worker_gpus["minReplicas"] or per_replica == 0
    pod_gpus = {int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
                for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]}
    if per_replica:
        assert per_replica in pod_gpus  # one replica's placement group fits on one worker pod (STRICT_PACK)
        pod_cpus = max(int(c["resources"]["limits"]["cpu"])
                       for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"])
        assert _generate().cpus_per_replica(app["args"]) <= pod_cpus  # and its bundles' CPUs too


def _pods(manifest: dict) -> list[dict]:
    cluster = manifest["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in cluster["workerGroupSpecs"])]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_secures_and_sizes_its_pods(path):
    """Ray's token auth on (dashboard and GCS); the proxy's envelope middleware everywhere; GPU
    pods get an in-memory /dev/shm and land only on GPUs their weights fit; auth keys come from
    a Secret."""
    manifest = yaml.safe_load(path.read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "ditserve-ray-token"}
    args = next(a for a in yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
                if a["import_path"] == "deployments.app:build_app")["args"]
    gpu = _generate().gpus_per_replica(args) > 0
    for pod in _pods(manifest):
        for container in pod["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]["value"] == "deployments.proxy:middlewares"
            if gpu:  # every GPU config turns auth on, with the key from the Secret
                assert args["auth"]["api_keys_env"] == "DITSERVE_API_KEYS"
                assert env["DITSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "ditserve-api-keys",
                                                                                 "key": "api-keys"}
            gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
            if gpus:
                volumes = {v["name"]: v for v in pod["volumes"]}
                assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
                assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
                (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                    "nodeSelectorTerms"]
                (rule,) = term["matchExpressions"]
                assert rule["key"] == "nvidia.com/gpu.memory" and rule["operator"] == "Gt"
                assert int(rule["values"][0]) == _generate().MIN_GPU_MEMORY_MIB[path.name.replace(".rayservice", "")]


def test_weights_fit_the_gpus_the_manifests_select():
    """bf16 weights of rank 0 while serving (the whole model on every rank, except where
    ``parallel.shard_weights`` spreads the transformers over the ranks, plus one gathered block
    and its prefetched neighbour) against the least GPU memory the manifest selects, leaving at
    least 15 % for activations, the VAE's work and CUDA's context; and the loading peak (every
    rank loads the whole transformers before sharding them) within 90 % (k8s/README.md has the
    arithmetic)."""
    wan = yaml.safe_load((ROOT / "configs" / "wan22-a14b-8gpu.yaml").read_text())["applications"][0]["args"]
    assert wan["parallel"]["shard_weights"]
    world = wan["parallel"]["cfg_degree"] * wan["parallel"]["ulysses_degree"] * wan["parallel"].get("ring_degree", 1)
    experts = 2 * 28.6
    assert experts / world + 2 * experts / 2 / 40 + 11.4 + 0.25 <= 0.85 * 79_000 * 2**20 / 1e9
    assert experts + 11.4 + 0.25 <= 0.90 * _generate().MIN_GPU_MEMORY_MIB["wan22-a14b-8gpu.yaml"] * 2**20 / 1e9
    weights_gb = {"flux-dev-1gpu.yaml": 23.8 + 9.5 + 0.25 + 0.17, "flux-dev-4gpu.yaml": 23.8 + 9.5 + 0.25 + 0.17,
                  "wan22-a14b-8gpu.yaml": experts / world + 2 * experts / 2 / 40 + 11.4 + 0.25,
                  "flux2-dev-4gpu.yaml": 64.4 + 48.0 + 0.17,
                  "qwen-image-1gpu.yaml": 40.9 + 16.6 + 0.25, "qwen-image-edit-1gpu.yaml": 40.9 + 16.6 + 0.25,
                  "z-image-turbo-1gpu.yaml": 12.3 + 8.0 + 0.17}
    for config, gb in weights_gb.items():
        mib = _generate().MIN_GPU_MEMORY_MIB[config]
        assert gb * 1e9 / 2**20 <= 0.85 * mib, (config, gb, mib)


def test_a_misspelled_field_is_caught():
    manifest = yaml.safe_load(MANIFESTS[0].read_text())
    broken = copy.deepcopy(manifest)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParms"] = {}
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(broken))
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    args = serve_config["applications"][0]["args"]
    args["batching"]["max_batch_sise"] = 4  # a typo inside the embedded config's args
    with pytest.raises(Exception, match="max_batch_sise"):
        AppConfig.model_validate(args)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_lets_kuberay_submit_its_serve_config(path):
    """KubeRay submits ``serveConfigV2`` to the head's dashboard (port named ``dashboard`` of
    the head Service) only once the head pod is Ready. The manifests bound the dashboard to the
    pod's loopback (the operator could not reach it) and gave the head a readiness probe on the
    app's ``/health`` at port 8000, which answers only after that submission: neither could
    ever deploy. No probe of ours (KubeRay injects its own where none is given), the dashboard
    on the pod's address, the head's ports under KubeRay's names."""
    cluster = yaml.safe_load(path.read_text())["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"].get("dashboard-host", "0.0.0.0") == "0.0.0.0"
    for pod in _pods(yaml.safe_load(path.read_text())):
        for container in pod["containers"]:
            assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(container), container["name"]
    (container,) = head["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000}
