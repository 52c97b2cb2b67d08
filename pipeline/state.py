"""The acceleration state of one rank as one value, and the pure table that moves it.

A replica changes state only at batch boundaries. :class:`ReplicaState` is what a rank holds:
the active LoRA adapter set, the attention kernel its layers dispatch to, the Cache-DiT key
mounted on each transformer, and the transformers already compiled. :func:`plan_transition`
decides, from the current state and the state a batch wants, the ordered actions that get there
(the design's order: adapters, kernel, then Cache-DiT, so Cache-DiT sees the adapted model, then
torch.compile, so compile traces the mounted path); the runner only
executes them (``pipeline.runner``). Pure and torch-free, so the table is tested directly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.cache_dit_params import CacheDiTParams
from pipeline.contract.lora import LoraSpec
from pipeline.modes import StrEnum


class StateTransitionError(RuntimeError):
    """Moving a rank to a batch's state failed (a kernel that cannot run, a Cache-DiT mount
    cache-dit refused). Raised before the denoising loop, so before any collective: when every
    rank of a replica raises it for the same batch, the ranks are still in step."""


class CacheTransition(StrEnum):
    """What happens to one transformer's Cache-DiT context at a batch boundary."""

    NONE = "none"          # off before and after
    MOUNT = "mount"        # off -> on
    REFRESH = "refresh"    # same key: resize the context for this batch's steps
    UNMOUNT = "unmount"    # on -> off
    REMOUNT = "remount"    # another key (knobs or CFG mode): unmount, then mount


class ActionKind(StrEnum):
    """One step of a state transition, as the runner performs it."""

    SET_LORAS = "set_loras"
    SWITCH_KERNEL = "switch_kernel"
    MOUNT = "mount"
    REFRESH = "refresh"
    UNMOUNT = "unmount"
    REMOUNT = "remount"
    COMPILE = "compile"


@dataclass(frozen=True)
class CacheKey:
    """What a mounted Cache-DiT context depends on, apart from the step count.

    ``params``: the transformer's effective override (an empty one: cache-dit's defaults).
    ``separate_cfg``: the batch really runs both the conditional and the guiding forward on
    this transformer at each step (cache-dit's ``enable_separate_cfg``).
    """

    params: CacheDiTParams
    separate_cfg: bool


@dataclass(frozen=True)
class ReplicaState:
    """The acceleration state of one rank.

    ``attention_backend``: the kernel every switchable layer dispatches to (None: diffusers'
    default). ``cache_dit``: ``(transformer name, key or None)`` pairs, sorted by name.
    ``compiled``: names of the transformers torch.compile has wrapped (never undone).
    ``loras``: the active LoRA adapter set, sorted by name (empty: the base model).

    As the *wanted* state of a batch, ``cache_dit`` lists only the transformers that run in
    it: a transformer absent from it keeps whatever it has.
    """

    attention_backend: str | None = None
    cache_dit: tuple[tuple[str, CacheKey | None], ...] = ()
    compiled: frozenset[str] = frozenset()
    loras: tuple[LoraSpec, ...] = ()

    def cache_key(self, name: str) -> CacheKey | None:
        return dict(self.cache_dit).get(name)

    def with_cache(self, name: str, key: CacheKey | None) -> "ReplicaState":
        cache = dict(self.cache_dit)
        cache[name] = key
        return replace(self, cache_dit=tuple(sorted(cache.items())))

    def unmounted(self) -> "ReplicaState":
        """The state after a failed Cache-DiT action: every transformer's hooks removed."""
        return replace(self, cache_dit=tuple((name, None) for name, _ in self.cache_dit))


@dataclass(frozen=True)
class Action:
    """One step: ``kind`` on ``target`` (a transformer name; for ``SWITCH_KERNEL`` the kernel
    name, None for diffusers' default), with the Cache-DiT ``key`` to mount or refresh, or for
    ``SET_LORAS`` the adapter set to activate (``loras``; target None)."""

    kind: ActionKind
    target: str | None
    key: CacheKey | None = None
    loras: tuple[LoraSpec, ...] = ()


def cache_transition(active: CacheKey | None, wanted: CacheKey | None) -> CacheTransition:
    """The Cache-DiT table of one transformer: (active, wanted) → its transition."""
    if wanted is None:
        return CacheTransition.NONE if active is None else CacheTransition.UNMOUNT
    if active is None:
        return CacheTransition.MOUNT
    return CacheTransition.REFRESH if active == wanted else CacheTransition.REMOUNT


def plan_transition(current: ReplicaState, wanted: ReplicaState) -> list[Action]:
    """The actions that move ``current`` to ``wanted``, in order: activate the adapter set (if
    it differs), switch the kernel (if it differs), one Cache-DiT action per transformer that
    runs (a same-key refresh included, which also resets the context after an adapter change),
    then compile each wanted transformer not compiled yet (after mounting, never twice)."""
    actions = []
    if wanted.loras != current.loras:
        actions.append(Action(ActionKind.SET_LORAS, None, loras=wanted.loras))
    if wanted.attention_backend != current.attention_backend:
        actions.append(Action(ActionKind.SWITCH_KERNEL, wanted.attention_backend))
    for name, key in wanted.cache_dit:
        transition = cache_transition(current.cache_key(name), key)
        if transition != CacheTransition.NONE:
            actions.append(Action(ActionKind(transition.value), name, key))
    for name in sorted(wanted.compiled - current.compiled):
        actions.append(Action(ActionKind.COMPILE, name))
    return actions


def after(state: ReplicaState, action: Action) -> ReplicaState:
    """The state once ``action`` has succeeded."""
    if action.kind == ActionKind.SET_LORAS:
        return replace(state, loras=action.loras)
    if action.kind == ActionKind.SWITCH_KERNEL:
        return replace(state, attention_backend=action.target)
    if action.kind == ActionKind.COMPILE:
        return replace(state, compiled=state.compiled | {action.target})
    return state.with_cache(action.target, None if action.kind == ActionKind.UNMOUNT else action.key)
