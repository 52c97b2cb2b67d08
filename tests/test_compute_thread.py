"""ComputeThread: every torch call of a replica process runs on one thread (one OpenMP pool;
see deployments/compute_thread.py for what two pools cost)."""

from __future__ import annotations

import ast
import asyncio
import threading
from pathlib import Path

import pytest

from deployments.compute_thread import ComputeThread

ROOT = Path(__file__).resolve().parents[1]


def test_call_and_run_use_one_thread_with_the_torch_thread_count():
    import torch

    compute = ComputeThread("test-compute", torch_threads=2)
    before = torch.get_num_threads()

    def where() -> tuple[int, int, float]:
        return threading.get_ident(), torch.get_num_threads(), float(torch.ones(64, 64).matmul(torch.ones(64, 64))[0, 0])

    first = compute.call(where)
    second = asyncio.run(compute.run(where))
    assert first == second == (first[0], 2, 64.0)
    assert first[0] != threading.get_ident()
    assert torch.get_num_threads() == before  # the caller's own setting is not touched


def test_calls_run_in_order_and_raise_what_they_raise():
    compute = ComputeThread("test-compute")
    seen = []

    async def both():
        return await asyncio.gather(compute.run(seen.append, 1), compute.run(seen.append, 2),
                                    compute.run(seen.append, 3))

    asyncio.run(both())
    assert seen == [1, 2, 3]
    with pytest.raises(ZeroDivisionError):
        compute.call(lambda: 1 / 0)
    with pytest.raises(KeyError, match="x"):
        asyncio.run(compute.run({}.__getitem__, "x"))
    assert compute.call(lambda: "still serving") == "still serving"


def test_calls_see_the_callers_context_and_the_thread_does_not_hold_up_exit():
    """Serve's request id lives in a ContextVar: log lines written on the thread keep it."""
    import contextvars

    request_id = contextvars.ContextVar("request_id", default=None)
    compute = ComputeThread("test-compute")
    request_id.set("req-1")
    assert compute.call(request_id.get) == "req-1"

    async def in_a_task():
        request_id.set("req-2")
        return await compute.run(request_id.get)

    assert asyncio.run(in_a_task()) == "req-2"
    assert next(t for t in threading.enumerate() if t.name == "test-compute").daemon


@pytest.mark.parametrize("module", ["deployments/replica.py", "deployments/rank_worker.py"])
def test_the_replica_and_its_ranks_run_torch_only_on_their_compute_thread(module):
    """No other thread of a replica or rank actor may run model code: no ``asyncio.to_thread``
    / ``run_in_executor`` there, and the runner is made, warmed up and run through ``call`` /
    ``run`` of the ComputeThread (``make_runner`` and the runner's methods passed, not called)."""
    tree = ast.parse((ROOT / module).read_text())
    on_compute = {arg.id for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Attribute) and node.func.attr in ("call", "run")
                  for arg in node.args[:1] if isinstance(arg, ast.Name)}  # local functions handed to it
    skipped = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in on_compute
               for inner in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            assert name not in ("to_thread", "run_in_executor"), f"{module}:{node.lineno} uses {name}"
            assert name != "make_runner", f"{module}:{node.lineno} calls make_runner outside its ComputeThread"
            if isinstance(node.func, ast.Attribute) and name in ("run", "denoise", "enable_parallel", "check"):
                owner = ast.unparse(node.func.value)
                assert not owner.endswith(("runner", "runner.lora")), \
                    f"{module}:{node.lineno} calls {owner}.{name} on the calling thread"
