"""Fault injection for chaos tests and drills, switched on by environment variables only.

``DITSERVE_FAIL_SIGNATURES_CONTAINING=TEXT``: a batch whose signature text contains TEXT fails
in the replica before it runs, as a model error would. ``DITSERVE_FAIL_RANK=RANK:TEXT[@STEP]``: rank
RANK alone raises after denoising step STEP (1 by default) of such a batch, while the other ranks
go on into the next step's collectives (what an out-of-memory on one GPU does); rank 0 is the
replica itself (a single-rank replica's model failing mid-batch).
``DITSERVE_EXIT_RANK=RANK:TEXT``: rank actor RANK (1 or more) exits, its process gone at once,
as such a batch begins, before its first step (a crashed GPU process or a killed host).
``DITSERVE_FAIL_STARTUP=TEXT``: the replica's constructor raises (a checkpoint that no longer
loads, a broken device), so a deploy or a redeploy of DiTReplica with it fails.
"""

from __future__ import annotations

import os

from pipeline.wire import Batch

FAULT_ENV = "DITSERVE_FAIL_SIGNATURES_CONTAINING"
RANK_FAULT_ENV = "DITSERVE_FAIL_RANK"
RANK_EXIT_ENV = "DITSERVE_EXIT_RANK"
STARTUP_FAULT_ENV = "DITSERVE_FAIL_STARTUP"


def startup_fault() -> str | None:
    """The injected failure of a replica's constructor, or None."""
    text = os.environ.get(STARTUP_FAULT_ENV)
    return f"injected startup fault ({text})" if text else None


def batch_fault(batch: Batch) -> str | None:
    """The injected failure of ``batch`` in the replica, or None."""
    text = os.environ.get(FAULT_ENV)
    return f"injected fault for signature {batch.signature}" if text and text in str(batch.signature) else None


def rank_fault(rank: int, batch: Batch, on_step=None):
    """``on_step`` (an ``on_step(done, total)`` callback, or None), made to raise on ``rank``
    after the configured step of a matching batch (:data:`RANK_FAULT_ENV`): the returned
    callback raises ``RuntimeError`` there. Raises ``ValueError`` for a malformed spec
    (:func:`parse_rank_fault`)."""
    fault = parse_rank_fault(os.environ.get(RANK_FAULT_ENV))
    if fault is None or fault[0] != rank or fault[1] not in str(batch.signature):
        return on_step
    step = fault[2]

    def fail(done: int, total: int) -> None:
        if on_step is not None:
            on_step(done, total)
        if done == step:
            raise RuntimeError(f"injected fault on rank {rank} after step {done} of batch {batch.batch_id}")

    return fail


def parse_rank_fault(spec: str | None) -> tuple[int, str, int] | None:
    """``RANK:TEXT[@STEP]`` as ``(rank, text, step)`` (step 1 when not given); None when unset.
    Raises ``ValueError`` naming :data:`RANK_FAULT_ENV` for a spec of another shape."""
    if not spec:
        return None
    target, colon, text = spec.partition(":")
    head, at, step = text.rpartition("@")
    if at:
        text = head
    if not colon or not target.isdigit() or not text or (at and not (step.isdigit() and int(step) >= 1)):
        raise ValueError(f"{RANK_FAULT_ENV}={spec!r}: expected RANK:TEXT or RANK:TEXT@STEP "
                         "(RANK >= 0, STEP >= 1, TEXT part of a batch signature)")
    return int(target), text, int(step) if at else 1


def rank_exit(rank: int, batch: Batch) -> bool:
    """Whether rank ``rank``'s process is to exit as ``batch`` begins (:data:`RANK_EXIT_ENV`)."""
    fault = parse_rank_exit(os.environ.get(RANK_EXIT_ENV))
    return fault is not None and fault[0] == rank and fault[1] in str(batch.signature)


def parse_rank_exit(spec: str | None) -> tuple[int, str] | None:
    """``RANK:TEXT`` as ``(rank, text)``; None when unset. Raises ``ValueError`` naming
    :data:`RANK_EXIT_ENV` for a spec of another shape or a rank below 1 (rank 0 is the replica
    itself, not a rank actor)."""
    if not spec:
        return None
    target, colon, text = spec.partition(":")
    if not colon or not target.isdigit() or int(target) < 1 or not text:
        raise ValueError(f"{RANK_EXIT_ENV}={spec!r}: expected RANK:TEXT (RANK >= 1, a rank actor; TEXT part of "
                         "a batch signature)")
    return int(target), text
