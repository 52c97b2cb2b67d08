"""Generate KubeRay ``RayService`` manifests from the Serve configs in ``configs/``.

Each manifest embeds its config file verbatim as ``spec.serveConfigV2`` (a test regenerates
them and fails on drift). GPU configs get a CPU-only head (``num-gpus: "0"``) and a GPU
worker group whose pods' ``nvidia.com/gpu`` limit equals one replica's placement-group
bundles; the model checkpoint comes from a PersistentVolumeClaim mounted at ``/models``.
A config whose DiTReplica autoscales (``replica.autoscaling``) gets KubeRay's in-tree Ray
autoscaler and a worker group sized from ``min_replicas`` to ``max_replicas`` replicas, so the
pods for a replica Serve adds are created on demand and removed when idle.

Every pod: Serve's proxy answers its own errors in OpenAI's envelope
(``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``), and Ray's token authentication guards the
dashboard, which listens where KubeRay puts it (the head service: its operator submits
``serveConfigV2`` through it). GPU pods: an in-memory ``emptyDir`` at ``/dev/shm`` (the 64 MB default breaks
NCCL's shared-memory transport) and a node affinity on the GPU memory NVIDIA's GPU feature
discovery labels nodes with (``nvidia.com/gpu.memory``, MiB), so a config lands only on GPUs
its weights fit. A config with ``auth.api_keys_env`` reads the keys from the Kubernetes Secret
``ditserve-api-keys`` (key ``api-keys``).

    python k8s/generate.py          # rewrites k8s/*.rayservice.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RAY_VERSION = "2.60.0"
RAY_TOKEN_SECRET = "ditserve-ray-token"  # the Secret holding Ray's auth token (key auth_token)
IMAGE = "ditserve:0.1.0"  # build from the repository (see k8s/README.md)
MANIFESTS = {  # config file -> (name, GPUs per worker pod or 0 for CPU-only, worker pods without autoscaling)
    "tiny-cpu-cluster.yaml": ("ditserve-tiny-cpu", 0, 1),
    "flux-dev-1gpu.yaml": ("ditserve-flux-dev-1gpu", 1, 1),
    "flux-dev-4gpu.yaml": ("ditserve-flux-dev-4gpu", 4, 1),
    "wan22-a14b-8gpu.yaml": ("ditserve-wan22-a14b-8gpu", 8, 1),
    "flux2-dev-4gpu.yaml": ("ditserve-flux2-dev-4gpu", 4, 1),
    "qwen-image-1gpu.yaml": ("ditserve-qwen-image-1gpu", 1, 1),
    "qwen-image-edit-1gpu.yaml": ("ditserve-qwen-image-edit-1gpu", 1, 1),
    "z-image-turbo-1gpu.yaml": ("ditserve-z-image-turbo-1gpu", 1, 1),
}
# config file -> the least GPU memory (MiB, as nvidia.com/gpu.memory reports it) its weights fit
# in with headroom; the arithmetic is in k8s/README.md. FLUX.1-dev bf16 (transformer 23.8 GB, T5
# 9.5 GB, CLIP and VAE) on every rank: a 48 GB-class GPU. Wan 2.2 A14B bf16 (two 14B experts
# 57 GB, UMT5 11.4 GB): sharded 8 ways while serving (20.3 GB on rank 0), but every rank loads
# both experts before sharding them: an 80 GB-class GPU. FLUX.2 [dev] bf16 (transformer 64.4 GB,
# Mistral Small 3.1 48.0 GB on rank 0): a 141 GB-class GPU. Qwen-Image bf16 (transformer 40.9 GB,
# Qwen2.5-VL-7B 16.6 GB), also Qwen-Image-Edit: an 80 GB-class GPU. Z-Image Turbo bf16 (transformer 12.3 GB, Qwen3-4B 8.0 GB):
# a 40 GB-class GPU.
MIN_GPU_MEMORY_MIB = {"flux-dev-1gpu.yaml": 45_000, "flux-dev-4gpu.yaml": 45_000, "wan22-a14b-8gpu.yaml": 79_000,
                      "flux2-dev-4gpu.yaml": 130_000, "qwen-image-1gpu.yaml": 79_000,
                      "qwen-image-edit-1gpu.yaml": 79_000,
                      "z-image-turbo-1gpu.yaml": 40_000}
API_KEYS_SECRET = {"name": "ditserve-api-keys", "key": "api-keys"}
PROXY_ENV = {"name": "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "value": "deployments.proxy:middlewares"}


def _per_replica(args: dict, bundle_key: str, actor_key: str, default: int) -> int:
    """A resource one DiTReplica holds: its ranks' bundles with sequence parallelism, else its actor's."""
    parallel = args.get("parallel", {})
    world = parallel.get("cfg_degree", 1) * parallel.get("ulysses_degree", 1) * parallel.get("ring_degree", 1)
    replica = args.get("replica", {})
    if world > 1:
        return int(world * replica.get("rank_resources", {}).get(bundle_key, default))
    return int(replica.get("ray_actor_options", {}).get(actor_key, default))


def gpus_per_replica(args: dict) -> int:
    """GPUs one DiTReplica holds: one per rank with sequence parallelism, else its actor's num_gpus."""
    return _per_replica(args, "GPU", "num_gpus", 0)


def cpus_per_replica(args: dict) -> int:
    """CPUs one DiTReplica holds: its ranks' bundles with sequence parallelism, else its actor's num_cpus."""
    return _per_replica(args, "CPU", "num_cpus", 1)


def replica_range(args: dict) -> tuple[int, int]:
    """(fewest, most) DiTReplicas: ``num_replicas`` twice, or autoscaling's min and max."""
    replica = args.get("replica", {})
    if scaling := replica.get("autoscaling"):
        return scaling.get("min_replicas", 1), scaling.get("max_replicas", 1)
    return (replica.get("num_replicas", 1),) * 2


def _container(name: str, gpus: int, cpu: str, memory: str, head: bool, api_keys_env: str | None) -> dict:
    limits = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = gpus
        container_mounts = [{"name": "models", "mountPath": "/models", "readOnly": True},
                            {"name": "dshm", "mountPath": "/dev/shm"}]
    else:
        container_mounts = []
    env = [{"name": "DITSERVE_CACHE_DIR", "value": "/tmp/ditserve"}, {"name": "HF_HUB_OFFLINE", "value": "1"},
           PROXY_ENV]
    if api_keys_env:
        env.append({"name": api_keys_env, "valueFrom": {"secretKeyRef": dict(API_KEYS_SECRET)}})
    container = {
        "name": name, "image": IMAGE,
        "resources": {"limits": limits, "requests": {"cpu": cpu, "memory": memory}},
        **({"volumeMounts": container_mounts} if container_mounts else {}),
        "env": env,
    }
    if head:  # KubeRay's port names: its head Service takes them from here
        container["ports"] = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                              {"containerPort": 10001, "name": "client"}, {"containerPort": 8000, "name": "serve"}]
    return container


def manifest(config_file: str) -> dict:
    name, gpus, workers = MANIFESTS[config_file]
    text = (ROOT / "configs" / config_file).read_text()
    args = next(a for a in yaml.safe_load(text)["applications"]
                if a["import_path"] == "deployments.app:build_app")["args"]
    autoscaling = bool(args.get("replica", {}).get("autoscaling"))
    api_keys_env = args.get("auth", {}).get("api_keys_env")
    min_workers = max_workers = workers
    if autoscaling and gpus:  # pods hold whole replicas: pods follow the replica count
        pods_per_replica = gpus_per_replica(args) // gpus
        min_workers, max_workers = (n * pods_per_replica for n in replica_range(args))
    volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": "ditserve-models"}}] if gpus else []
    head = _container("ray-head", 0, "4", "16Gi", head=True, api_keys_env=api_keys_env)
    if gpus:
        head["volumeMounts"] = [{"name": "models", "mountPath": "/models", "readOnly": True}]
    # No probes of our own: KubeRay injects its own (raylet and GCS health; on workers Serve's
    # proxy too) only where none is given, and it submits serveConfigV2 only once the head pod is
    # Ready, so a readiness probe on the app (port 8000) waited for itself and never passed.
    # A GPU pod holds whole replicas: at least their bundles' CPUs, and 32 GiB of memory per GPU.
    worker_cpus = str(max(32, cpus_per_replica(args) * gpus // max(gpus_per_replica(args), 1))) if gpus else "4"
    worker = _container("ray-worker", gpus, worker_cpus, f"{max(128, 32 * gpus)}Gi" if gpus else "16Gi",
                        head=False, api_keys_env=api_keys_env)
    worker_volumes = volumes + ([{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{16 * gpus}Gi"}}]
                                if gpus else [])
    affinity = {}
    if config_file in MIN_GPU_MEMORY_MIB:
        affinity = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "nvidia.com/gpu.memory", "operator": "Gt",
                                                         "values": [str(MIN_GPU_MEMORY_MIB[config_file])]}]}]}}}}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "ditserve"}},
        "spec": {
            "serveConfigV2": text,
            "upgradeStrategy": {"type": "NewCluster"},
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                # Ray's token authentication (Ray >= 2.52, KubeRay >= 1.5.1): the dashboard, which
                # the operator submits serveConfigV2 to over the head Service, and GCS take only
                # requests carrying the token of this Secret (key auth_token); Serve's HTTP port
                # is ditserve's own (auth.api_keys_env)
                "authOptions": {"mode": "token", "secretName": RAY_TOKEN_SECRET},
                **({"enableInTreeAutoscaling": True} if autoscaling else {}),
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "num-gpus": "0"},
                    "template": {"spec": {"containers": [head], **({"volumes": volumes} if volumes else {})}},
                },
                "workerGroupSpecs": [{
                    "groupName": "gpu-workers" if gpus else "cpu-workers",
                    "replicas": min_workers, "minReplicas": min_workers, "maxReplicas": max_workers,
                    "rayStartParams": {},
                    "template": {"spec": {"containers": [worker],
                                          **({"volumes": worker_volumes} if worker_volumes else {}),
                                          **affinity,
                                          **({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                               "effect": "NoSchedule"}]} if gpus else {})}},
                }],
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(config_file: str) -> str:
    header = f"# Generated by k8s/generate.py from configs/{config_file}; edit the config, then regenerate.\n"
    return header + yaml.dump(manifest(config_file), Dumper=_Dumper, sort_keys=False, width=120)


def main() -> int:
    for config_file in MANIFESTS:
        out = ROOT / "k8s" / f"{config_file.removesuffix('.yaml')}.rayservice.yaml"
        out.write_text(render(config_file))
        print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
