"""The replica-state table: ``plan_transition`` over every pair of states, failures included."""

from __future__ import annotations

import itertools

import pytest

from pipeline.cache_dit_params import CacheDiTParams
from pipeline.state import (Action, ActionKind, CacheKey, CacheTransition, ReplicaState, after, cache_transition,
                            plan_transition)

A = CacheKey(CacheDiTParams(), False)
B = CacheKey(CacheDiTParams(Fn_compute_blocks=2), False)
A_CFG = CacheKey(CacheDiTParams(), True)  # same knobs, but the batch runs a separate guiding forward
T, T2 = "transformer", "transformer_2"


def state(kernel=None, cache=(), compiled=()):
    return ReplicaState(kernel, tuple(sorted(cache)), frozenset(compiled))


K, M, R, U, C = (ActionKind.SWITCH_KERNEL, ActionKind.MOUNT, ActionKind.REFRESH, ActionKind.UNMOUNT,
                 ActionKind.COMPILE)


@pytest.mark.parametrize("current, wanted, actions", [
    (state(), state(), []),
    (state(), state(cache=[(T, None)]), []),                                  # off stays off
    (state(), state(cache=[(T, A)]), [Action(M, T, A)]),                      # mount
    (state(cache=[(T, A)]), state(cache=[(T, A)]), [Action(R, T, A)]),        # same key: refresh
    (state(cache=[(T, A)]), state(cache=[(T, B)]), [Action(ActionKind.REMOUNT, T, B)]),
    (state(cache=[(T, A)]), state(cache=[(T, A_CFG)]), [Action(ActionKind.REMOUNT, T, A_CFG)]),  # CFG mode
    (state(cache=[(T, A)]), state(cache=[(T, None)]), [Action(U, T)]),        # unmount
    (state(cache=[(T, A)]), state(), []),                                     # not running: kept
    (state(), state(kernel="torch_math"), [Action(K, "torch_math")]),
    (state(kernel="torch_math"), state(), [Action(K, None)]),                 # back to the default
    (state(), state(compiled=[T]), [Action(C, T)]),
    (state(compiled=[T]), state(compiled=[T]), []),                           # compile once
    # order: kernel, then each running transformer's Cache-DiT action, then compile
    (state(cache=[(T, A), (T2, None)]), state("fa", [(T, B), (T2, A)], [T, T2]),
     [Action(K, "fa"), Action(ActionKind.REMOUNT, T, B), Action(M, T2, A), Action(C, T), Action(C, T2)]),
    # boundary experts: only the expert that runs in the batch moves
    (state(cache=[(T, A), (T2, A)]), state(cache=[(T2, None)]), [Action(U, T2)]),
])
def test_transition_table(current, wanted, actions):
    assert plan_transition(current, wanted) == actions


KERNELS = (None, "torch_math")
KEYS = (None, A, B, A_CFG)
COMPILED = ((), (T,))
STATES = [state(k, [(T, key)], c) for k, key, c in itertools.product(KERNELS, KEYS, COMPILED)]


@pytest.mark.parametrize("current, wanted", list(itertools.product(STATES, STATES)))
def test_every_pair_reaches_the_wanted_state_in_order(current, wanted):
    actions = plan_transition(current, wanted)
    reached = current
    for action in actions:
        reached = after(reached, action)
    assert reached.attention_backend == wanted.attention_backend
    assert reached.cache_key(T) == wanted.cache_key(T)
    assert reached.compiled == current.compiled | wanted.compiled  # compiled modules stay compiled
    kinds = [a.kind for a in actions]
    assert kinds.count(K) == (current.attention_backend != wanted.attention_backend)
    assert kinds.count(C) == len(wanted.compiled - current.compiled)  # never twice
    order = [0 if k == K else 2 if k == C else 1 for k in kinds]
    assert order == sorted(order)  # kernel, Cache-DiT, compile
    transition = cache_transition(current.cache_key(T), wanted.cache_key(T))
    cache_actions = [a for a in actions if a.kind not in (K, C)]
    assert [a.kind.value for a in cache_actions] == ([] if transition == CacheTransition.NONE else [transition.value])


@pytest.mark.parametrize("key", [A, B, A_CFG])
def test_a_failed_mount_leaves_the_rank_unmounted_and_the_next_batch_mounts(key):
    """The runner executes MOUNT; cache-dit raises; the rank's state becomes ``unmounted()``."""
    current = state("torch_math", [(T, None)], [T])
    (mount,) = plan_transition(current, state("torch_math", [(T, key)], [T]))
    assert mount == Action(M, T, key)
    failed = current.unmounted()
    assert failed.cache_key(T) is None and failed.attention_backend == "torch_math" and failed.compiled == {T}
    assert plan_transition(failed, state("torch_math", [(T, key)], [T])) == [Action(M, T, key)]
    # a failure while mounted on both transformers unmounts both
    both = state(cache=[(T, A), (T2, B)]).unmounted()
    assert (both.cache_key(T), both.cache_key(T2)) == (None, None)
    assert plan_transition(both, state(cache=[(T, A), (T2, B)])) == [Action(M, T, A), Action(M, T2, B)]


def test_transitions_name_the_metadata_values():
    assert [t.value for t in CacheTransition] == ["none", "mount", "refresh", "unmount", "remount"]
    assert {ActionKind(t.value) for t in CacheTransition if t != CacheTransition.NONE} <= set(ActionKind)
