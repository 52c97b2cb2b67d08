"""Operating ditserve on a Ray cluster of its own (``ray start --head``), as a user would:
deploy a config file with ``serve run``, call the app through a Serve handle from another Ray
job, and find ditserve's metrics in Ray's Prometheus export.

The cluster runs in subprocesses with its own temporary dir and ports, so it never touches the
session's in-process test cluster (tests/conftest.py). It is stopped by signalling its process
group and then any process still naming its temporary dir, never with ``ray stop`` (which stops
every Ray cluster on the machine).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image

from parallel.groups import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's `ray` and `serve` scripts
# Ray's custom metrics from deployments/router.py (and the replica's LoRA loads), as the metrics export names them.
METRICS = ("ditserve_queue_depth", "ditserve_batch_images", "ditserve_queue_wait_ms", "ditserve_routing_decisions",
           "ditserve_rejections", "ditserve_lora_loads", "ditserve_cancelled_queued", "ditserve_batches",
           "ditserve_requests", "ditserve_state_changes")


@dataclass
class OpsCluster:
    address: str       # GCS address, for ray.init(address=...)
    metrics_url: str   # the node's Prometheus export endpoint
    tmp: Path
    env: dict


def _own_pids(tmp: Path, pgid: int) -> list[int]:
    """Processes of this test's cluster still running: in the head's process group, or naming
    its temp dir (zombies are done: they only wait for their parent to reap them)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            zombie = (entry / "stat").read_bytes().rpartition(b")")[2].split()[0] == b"Z"
            if zombie and len(os.listdir(entry / "task")) == 1:  # (a live thread group shows Z after its leader exits)
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            in_group = os.getpgid(int(entry.name)) == pgid
        except (OSError, ProcessLookupError, IndexError):
            continue
        if in_group or str(tmp) in cmdline:
            pids.append(int(entry.name))
    return pids


def _stop(head: subprocess.Popen, tmp: Path) -> None:
    for sig, grace_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        pids = _own_pids(tmp, head.pid)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _own_pids(tmp, head.pid):
            head.poll()  # reaps `ray start` once it exits
            time.sleep(0.5)
        if head.poll() is None:
            try:
                head.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
    shutil.rmtree(tmp, ignore_errors=True)
    assert not _own_pids(tmp, head.pid), "processes of the test cluster survived SIGKILL"


def _run(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.fixture(scope="module")
def ops_cluster():
    tmp = Path(tempfile.mkdtemp(prefix="dsops-", dir="/tmp"))  # short: Ray's unix sockets live under it
    port = {name: free_port("127.0.0.1") for name in ("gcs", "node_manager", "object_manager", "client", "agent",
                                                      "agent_grpc", "runtime_env", "metrics", "http")}
    low = free_port("127.0.0.1")
    while any(low <= p <= low + 200 for p in port.values()):  # Ray refuses a worker range that overlaps
        low = free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    # Ray's token authentication, as `ray start` enables it by default when ~/.ray/auth_token
    # exists; processes that connect with an explicit address must say so (README).
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_metrics_report_interval_ms"] = "1000"  # export every second rather than every 10 s
    env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] = "deployments.proxy:middlewares"
    head = subprocess.Popen(
        [str(a) for a in [BIN / "ray", "start", "--head", "--block", "--temp-dir", tmp, "--num-cpus", "8", "--num-gpus", "0",
         "--node-ip-address", "127.0.0.1", "--port", port["gcs"], "--node-manager-port", port["node_manager"],
         "--object-manager-port", port["object_manager"], "--ray-client-server-port", port["client"],
         "--include-dashboard", "false", "--dashboard-agent-listen-port", port["agent"],
         "--dashboard-agent-grpc-port", port["agent_grpc"], "--runtime-env-agent-port", port["runtime_env"],
         "--metrics-export-port", port["metrics"], "--min-worker-port", low, "--max-worker-port", low + 200]],
        cwd=ROOT, env=env, stdout=(tmp / "head.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    cluster = OpsCluster(f"127.0.0.1:{port['gcs']}", f"http://127.0.0.1:{port['metrics']}/metrics", tmp, env)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (tmp / "head.log").read_text():
            assert head.poll() is None and time.monotonic() < deadline, (tmp / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        # Deploy as a user would: a Serve config file, `serve run --non-blocking` against the cluster.
        config = yaml.safe_load((ROOT / "configs" / "tiny-cpu.yaml").read_text())
        config["http_options"] = {"host": "127.0.0.1", "port": port["http"]}
        config["applications"][0]["args"]["replica"] = {"num_replicas": 1, "torch_threads": 1,
                                                        "ray_actor_options": {"num_cpus": 1}}
        (tmp / "serve.yaml").write_text(yaml.safe_dump(config))
        proc = _run(env, BIN / "serve", "run", tmp / "serve.yaml", "--address", cluster.address, "--non-blocking")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield cluster
    finally:
        _stop(head, tmp)


CLIENT = textwrap.dedent("""
    import base64, json, sys, time
    import ray
    from ray import serve
    from pipeline.errors import InvalidRequestError, RequestTimeoutError

    ray.init(address=sys.argv[1], log_to_driver=False)
    deadline = time.monotonic() + 600
    while serve.status().applications.get("ditserve") is None or \\
            serve.status().applications["ditserve"].status != "RUNNING":
        assert time.monotonic() < deadline, serve.status()
        time.sleep(1)
    handle = serve.get_app_handle("ditserve")
    body = lambda i: {"prompt": f"a shape {i}", "seed": i, "num_inference_steps": 4, "size": "64x48"}
    out = {}
    burst = [handle.generate.remote(body(i)) for i in range(6)]  # all six in flight at once
    out["burst"] = [{"png": r.data[0].b64_json, **r.ditserve.model_dump()} for r in (b.result(timeout_s=300) for b in burst)]
    try:
        handle.generate.remote({"prompt": "", "num_inference_steps": 0}).result(timeout_s=300)
    except InvalidRequestError as exc:  # Ray re-raises it as a subclass of the original (exc.cause)
        out["invalid"] = {"type": type(exc.cause).__name__, "status": exc.status_code, "param": exc.param,
                          "message": exc.message}
    try:  # a deadline shorter than any batch: answered with a typed error, counted as a rejection
        handle.generate.remote({**body(7), "timeout_s": 0.001}).result(timeout_s=300)
    except RequestTimeoutError as exc:
        out["timeout"] = {"type": type(exc.cause).__name__, "status": exc.status_code}
    out["after"] = handle.generate.remote(body(0)).result(timeout_s=300).data[0].b64_json
    # a request cancelled while it waits behind a running batch of another signature (steps)
    # (waits on the Router's state, not fixed sleeps: the 100-step 64x64 batch lasted 1.3 s here, and
    # a machine 1.3x faster ran the "cancelled" request after it)
    from tests.helpers import wait_until

    until = lambda predicate: wait_until(lambda: predicate(handle.stats.remote().result(timeout_s=60)["router"]),
                                         timeout=120)
    cancelled_before = handle.stats.remote().result(timeout_s=60)["router"]["counters"].get("cancelled", 0)
    running = handle.generate.remote({**body(9), "n": 4, "num_inference_steps": 100, "size": "128x128"})
    until(lambda r: r["inflight_batches"] == 1 and r["queued"] == 0)
    queued = handle.generate.remote(body(10))
    until(lambda r: r["queued"] == 1)
    queued.cancel()
    until(lambda r: r["counters"].get("cancelled", 0) == cancelled_before + 1)
    running.result(timeout_s=300)
    lora = handle.generate.remote({**body(8), "lora": [{"name": "magenta"}]}).result(timeout_s=300)
    out["lora"] = lora.ditserve.acceleration.lora.model_dump()
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def client_run(ops_cluster):
    """One separate driver process: a concurrent burst, an invalid request, a deadline miss, one more,
    a request cancelled while queued."""
    proc = _run(ops_cluster.env, sys.executable, "-c", CLIENT, ops_cluster.address, timeout=900)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line[0][len("RESULT"):])


def _png(b64: str | bytes) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


def test_the_queue_depth_gauge_is_exported_before_any_request(ops_cluster):
    """Runs before ``client_run`` sends the first request: the Router's 1 s watch, which sets the
    gauge, started only with the first request, so a fresh or replaced Router exported no
    queue depth at all (helper-67; dashboards' ``absent()`` alerts fired on an idle app)."""
    deadline = time.monotonic() + 300  # the app starting, then the periodic export: a bounded wait
    depth: list[str] = []
    while time.monotonic() < deadline:
        depth = [s for s in _scrape(ops_cluster.metrics_url)[1] if s.startswith("ray_ditserve_queue_depth{")]
        if {p for p in ("interactive", "batch") for s in depth if f'priority="{p}"' in s} == {"interactive", "batch"}:
            break
        time.sleep(1)
    assert depth and all(s.endswith(" 0.0") for s in depth), depth
    assert not any(s.startswith("ray_ditserve_requests_total") for s in _scrape(ops_cluster.metrics_url)[1])


def test_handle_from_another_job_burst_and_typed_errors(client_run):
    burst = client_run["burst"]
    assert len(burst) == 6 and len({r["request_id"] for r in burst}) == 6
    for r in burst:
        image = _png(r["png"])
        assert image.format == "PNG" and image.size == (64, 48)
    assert max(r["batch_size"] for r in burst) > 1  # the burst was batched
    assert client_run["invalid"]["type"] == "InvalidRequestError" and client_run["invalid"]["status"] == 400
    assert "prompt" in client_run["invalid"]["message"] and "num_inference_steps" in client_run["invalid"]["message"]
    assert client_run["timeout"]["type"] == "RequestTimeoutError"
    # Still serving after the errors: the same request again gives the same picture. It ran
    # alone this time and inside the burst's batch before; fp32 batch invariance holds to ~1e-5,
    # so a few values may round to the neighbouring uint8 level in the PNG.
    after = np.asarray(_png(client_run["after"]), dtype=np.int16)
    assert np.abs(after - np.asarray(_png(burst[0]["png"]), dtype=np.int16)).max() <= 1
    assert client_run["lora"] == {"active": ["magenta:1"], "loads": 1}  # the config file's embedded adapter


def test_example_handle_client_runs(ops_cluster, client_run):
    out = ops_cluster.tmp / "example.png"
    proc = _run(ops_cluster.env, sys.executable, ROOT / "examples" / "handle_client.py", "--address",
                ops_cluster.address, "--count", "2", "--steps", "4", "-o", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for name in ("example-0.png", "example-1.png"):
        assert _png(base64.b64encode((ops_cluster.tmp / name).read_bytes())).format == "PNG"
    assert "invalid request -> InvalidRequestError (400" in proc.stdout


# The names Ray's Prometheus export gives them (README, "Metrics"): Ray prefixes ``ray_``,
# counters get ``_total``, histograms ``_bucket`` / ``_count`` / ``_sum``.
EXPORTED = {
    "ditserve_queue_depth": ["ray_ditserve_queue_depth"],
    "ditserve_batch_images": ["ray_ditserve_batch_images_bucket", "ray_ditserve_batch_images_count",
                              "ray_ditserve_batch_images_sum"],
    "ditserve_queue_wait_ms": ["ray_ditserve_queue_wait_ms_bucket", "ray_ditserve_queue_wait_ms_count",
                               "ray_ditserve_queue_wait_ms_sum"],
    "ditserve_routing_decisions": ["ray_ditserve_routing_decisions_total"],
    "ditserve_rejections": ["ray_ditserve_rejections_total"],
    "ditserve_lora_loads": ["ray_ditserve_lora_loads_total"],  # DiTReplica's (configs/tiny-cpu.yaml's adapters)
    "ditserve_cancelled_queued": ["ray_ditserve_cancelled_queued_total"],  # the client's cancelled queued request
    "ditserve_batches": ["ray_ditserve_batches_total"],
    "ditserve_requests": ["ray_ditserve_requests_total"],
    "ditserve_state_changes": ["ray_ditserve_state_changes_total"],  # DiTReplica's: the client's n=4 batch, its LoRA
}


def _scrape(metrics_url: str) -> tuple[dict[str, list[str]], list[str], set[str]]:
    """Exported ditserve sample names grouped by metric, the ditserve samples, all names."""
    lines = [ln for ln in httpx.get(metrics_url, timeout=10).text.splitlines() if ln and not ln.startswith("#")]
    names = {re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", ln).group(0) for ln in lines}
    found = {m: sorted(n for n in names if n.startswith(f"ray_{m}_") or n == f"ray_{m}") for m in METRICS}
    return found, [ln for ln in lines if ln.startswith("ray_ditserve_")], names


def test_ditserve_metrics_in_prometheus_export(ops_cluster, client_run):
    deadline = time.monotonic() + 120  # the export is periodic; a bounded wait, not a timing assertion
    found, samples, names = _scrape(ops_cluster.metrics_url)
    while not all(found.values()) and time.monotonic() < deadline:
        time.sleep(1)
        found, samples, names = _scrape(ops_cluster.metrics_url)
    print("exported:", json.dumps(found), *samples, sorted(n for n in names if n.startswith("ray_serve_")),
          sep="\n")
    assert found == EXPORTED
    assert any(s.startswith("ray_ditserve_rejections_total{") and 'reason="timeout"' in s for s in samples)
    assert any(s.startswith("ray_ditserve_routing_decisions_total{") and 'decision="' in s for s in samples)
    assert any(s.startswith("ray_ditserve_queue_depth{") and 'priority="interactive"' in s for s in samples)
    assert not any(s.startswith("ray_ditserve_queue_depth{") and "signature=" in s for s in samples)  # unbounded
    assert any('application="ditserve"' in s for s in samples)
    assert any(n.startswith("ray_serve_") for n in names)  # Serve's own metrics come through the same export
    # the queue-depth gauge stays exported while nothing changes: Ray's agent drops a gauge value
    # not set again within two report intervals (1 s here), and a standing backlog (or an idle
    # app's 0) vanished from the export
    time.sleep(5)
    for _ in range(3):
        depth = [s for s in _scrape(ops_cluster.metrics_url)[1] if s.startswith("ray_ditserve_queue_depth{")]
        assert {p for p in ("interactive", "batch") for s in depth if f'priority="{p}"' in s} == {"interactive", "batch"}, depth
        time.sleep(1)
