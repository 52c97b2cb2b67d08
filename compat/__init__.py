"""Private APIs of our dependencies behind one door per dependency.

Where ditserve must use a dependency's private attribute, it goes through the module named for
that dependency (``compat.diffusers``, ``compat.cache_dit``, ``compat.yunchang``,
``compat.ray_serve``), never directly. Each module lists what it relies on in ``RELIES_ON`` and
``check()`` returns what an installed version lacks; ``tests/test_compat.py`` fails with those
messages when an upgrade removes something. ``pyproject.toml`` bounds the versions tested.
``compat.ray_serve`` is imported only by ``deployments/`` (Ray stays out of the numerical core).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import version


class CompatError(RuntimeError):
    """A dependency lacks a private API ditserve relies on (an upgrade beyond the tested range)."""


@dataclass(frozen=True)
class Reliance:
    """One private thing ditserve uses: ``module`` and a dotted ``path`` inside it."""

    module: str
    path: str
    why: str

    def present(self) -> bool:
        """Whether ``module`` imports and has every attribute of ``path``."""
        try:
            obj = importlib.import_module(self.module)
        except ImportError:
            return False
        for part in self.path.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True


def missing(distribution: str, tested: str, relies_on: tuple[Reliance, ...]) -> list[str]:
    """Messages for every reliance the installed ``distribution`` lacks (empty: all present)."""
    installed = version(distribution)
    return [f"{distribution} {installed} lacks {r.module}.{r.path} ({r.why}); ditserve is tested with "
            f"{distribution}{tested}" for r in relies_on if not r.present()]


def require(distribution: str, tested: str, reliance: Reliance) -> None:
    """Raise :class:`CompatError` naming ``reliance`` if the installed version lacks it."""
    problems = missing(distribution, tested, (reliance,))
    if problems:
        raise CompatError(problems[0])
