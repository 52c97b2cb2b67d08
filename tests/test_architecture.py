"""The layering the design promises, checked on the source: who may import whom, and which
processes never load torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (at any depth of the file)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("module", ["deployments.ingress", "deployments.router"])
def test_routing_processes_never_import_torch(module):
    """The Ingress and the Router only route: importing them (and so their Serve replicas) loads
    neither torch nor diffusers."""
    code = (f"import sys, {module}; loaded = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules];"
            " print(','.join(loaded))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"{module} loads {out.stdout.strip()}"


def test_wire_and_contract_modules_are_torch_free():
    for path in [ROOT / "pipeline" / name for name in ("wire.py", "modes.py", "sampling.py", "signature.py",
                                                      "state.py", "cache_dit_params.py", "errors.py")] + \
            _sources("pipeline/contract") + [ROOT / "parallel" / "kernels.py"]:
        assert not {m for m in _imports(path) if m.split(".")[0] in ("torch", "diffusers")}, path


@pytest.mark.parametrize("package, forbidden", [
    ("pipeline", {"deployments", "ray"}),          # the numerical core never imports the Serve layer or Ray
    ("parallel", {"deployments", "pipeline", "ray"}),
    ("compat", {"deployments", "pipeline", "parallel"}),
])
def test_layers_import_only_downwards(package, forbidden):
    for path in _sources(package):
        if package == "compat" and path.name == "ray_serve.py":
            continue
        bad = {m for m in _imports(path) if m.split(".")[0] in forbidden}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_ray_serve_compat_is_only_for_the_serve_layer():
    for package in ("pipeline", "parallel"):
        for path in _sources(package):
            assert "compat.ray_serve" not in _imports(path), path


def test_private_apis_go_through_compat():
    """No module outside ``compat/`` names the private attributes compat wraps."""
    private = ("_cp_plan", "_attention_backend", "_AttentionBackendRegistry", "_check_attention_backend_requirements",
               "_cached_context_manager", "_context_manager", "_replicas_list", "_deployment_id",
               "_get_global_client", "_pack_latents", "_unpack_latents", "_prepare_latent_image_ids",
               "_get_t5_prompt_embeds", "_get_qkv_projections", "_modeling_parallel",
               "_scaled_dot_product_efficient_attention")
    used = re.compile(r"(?<![\w])(" + "|".join(private) + r")\b")  # the bare private name, not a wrapper's
    for package in ("pipeline", "parallel", "deployments", "bench", "tests", "examples"):
        for path in _sources(package):
            if path.name == "test_architecture.py":
                continue
            text = re.sub(r'"""(.|\n)*?"""', "", path.read_text())  # docstrings may name them
            code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))  # comments too
            found = sorted(set(used.findall(code)))
            assert not found, f"{path.relative_to(ROOT)} uses {found} (go through compat/)"


# Exceptions whose constructor takes more than a message, built with every field set.
_ERROR_EXAMPLES = {
    "BatchCancelled": lambda cls: cls(3, 6, {1: 2}),
    "AdapterLoadError": lambda cls: cls("style", ValueError("not a LoRA"), "not a LoRA file"),
    "VideoJobFailed": lambda cls: cls("video-1", "generation_failed", "the replica stopped"),
    "VideoJobLost": lambda cls: cls("video-1", ConnectionRefusedError("refused")),
}


def _exception_classes() -> list[type]:
    """Every exception class defined in the product's packages (found on the source, then imported)."""
    import importlib
    import inspect
    found = []
    for package in ("pipeline", "deployments", "parallel", "compat"):
        for path in _sources(package):
            names = [node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                     and any(re.search(r"(Error|Exception|Cancelled|Broken|Failure)$", ast.unparse(base))
                             for base in node.bases)]
            if names:
                module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
                found += [getattr(module, name) for name in names
                          if inspect.isclass(getattr(module, name)) and issubclass(getattr(module, name), BaseException)]
    return found


def test_every_exception_survives_pickling_with_its_fields():
    """Errors cross Ray (rank -> rank 0, replica -> Router -> Ingress) pickled: each comes back
    the same type with the same message and fields. ``BatchCancelled`` did not (pickling
    re-called ``__init__`` with the message alone, so rank 1's stop reached rank 0 as an
    unpicklable error and the replica was broken instead of kept)."""
    import pickle
    classes = _exception_classes()
    assert {"BatchCancelled", "DitServeError", "GroupBroken", "AdapterLoadError"} <= {c.__name__ for c in classes}
    for cls in classes:
        error = _ERROR_EXAMPLES.get(cls.__name__, lambda c: c("what went wrong"))(cls)
        if isinstance(error, Exception) and hasattr(error, "param"):  # DitServeError: every keyword set
            error = cls("what went wrong", param="field", code="a_code", request_id="img-1")
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls and str(back) == str(error), cls
        assert {k: repr(v) for k, v in vars(back).items()} == {k: repr(v) for k, v in vars(error).items()}, cls


def test_every_method_serve_calls_on_our_deployments_runs_on_their_event_loop():
    """Serve runs a deployment's plain ``def`` methods in a thread pool
    (``RAY_SERVE_RUN_SYNC_IN_THREADPOOL``, on by default), beside the event loop that owns the
    Router's queues, leases and video jobs. helper-77: ``list_jobs`` in a thread while
    ``create_job`` evicted on the loop made a valid video create a 500 ("dictionary changed size
    during iteration"). So every method a handle, a health check or the routing stats can call is
    a coroutine (or an async generator); the private ones are called from those."""
    import inspect

    from ray.serve._private.constants import RAY_SERVE_RUN_SYNC_IN_THREADPOOL

    from deployments.ingress import Ingress
    from deployments.replica import DiTReplica
    from deployments.router import Router

    assert RAY_SERVE_RUN_SYNC_IN_THREADPOOL  # what makes a plain def run off the loop
    sync = [f"{deployment.name}.{name}" for deployment in (Router, Ingress, DiTReplica)
            for name, method in inspect.getmembers(deployment.func_or_class, inspect.isfunction)
            if not name.startswith("_")
            and not (inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method))]
    assert sync == []
