"""Fault injection for chaos tests and drills, switched on by environment variables only.

``DITSERVE_FAIL_SIGNATURES_CONTAINING=TEXT``: a batch whose signature text contains TEXT fails
in the replica before it runs, as a model error would. ``DITSERVE_FAIL_RANK=RANK:TEXT``: rank
RANK alone raises after the first denoising step of such a batch, while the other ranks go on
into the next step's collectives (what an out-of-memory on one GPU does).
``DITSERVE_FAIL_STARTUP=TEXT``: the replica's constructor raises (a checkpoint that no longer
loads, a broken device), so a deploy or a redeploy of DiTReplica with it fails.
"""

from __future__ import annotations

import os

from pipeline.wire import Batch

FAULT_ENV = "DITSERVE_FAIL_SIGNATURES_CONTAINING"
RANK_FAULT_ENV = "DITSERVE_FAIL_RANK"
STARTUP_FAULT_ENV = "DITSERVE_FAIL_STARTUP"


def startup_fault() -> str | None:
    """The injected failure of a replica's constructor, or None."""
    text = os.environ.get(STARTUP_FAULT_ENV)
    return f"injected startup fault ({text})" if text else None


def batch_fault(batch: Batch) -> str | None:
    """The injected failure of ``batch`` in the replica, or None."""
    text = os.environ.get(FAULT_ENV)
    return f"injected fault for signature {batch.signature}" if text and text in str(batch.signature) else None


def rank_fault(rank: int, batch: Batch):
    """An ``on_step`` callback that raises on ``rank`` after step 1 of a matching batch, or None."""
    spec = os.environ.get(RANK_FAULT_ENV)
    if not spec or ":" not in spec:
        return None
    target, _, text = spec.partition(":")
    if int(target) != rank or text not in str(batch.signature):
        return None

    def fail(done: int, _total: int) -> None:
        raise RuntimeError(f"injected fault on rank {rank} after step {done} of batch {batch.batch_id}")

    return fail
