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
