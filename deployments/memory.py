"""Giving memory back after a burst, in the processes that only route (Ingress, Router).

A burst of thousands of requests leaves CPython's and glibc's allocators holding freed memory:
the resident size stays at the burst's peak. Once a process has been idle for a moment after
work, :class:`IdleTrimmer` collects garbage and asks glibc to return free memory to the
operating system (``malloc_trim(0)``; a no-op where glibc is not the allocator).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import time

IDLE_S = 5.0  # quiet this long after work before trimming


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (looked up once: ``find_library`` runs ``ldconfig``)."""
    libc_name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc_name), "malloc_trim", None) if libc_name else None


def release_free_memory() -> None:
    """Collect garbage, then return the allocator's free memory to the OS where glibc allows."""
    gc.collect()
    if (trim := _malloc_trim()) is not None:
        trim(0)


class IdleTrimmer:
    """Call :meth:`busy` when work arrives; a background task releases free memory once the
    process has been idle for ``IDLE_S`` after some work (never while it is busy)."""

    def __init__(self, in_flight) -> None:
        self._in_flight = in_flight  # () -> requests this process holds right now
        self._last_work = 0.0
        self._dirty = False
        self._task: asyncio.Task | None = None

    def busy(self) -> None:
        self._last_work, self._dirty = time.monotonic(), True
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(IDLE_S)
            if self._dirty and self._in_flight() == 0 and time.monotonic() - self._last_work >= IDLE_S:
                self._dirty = False
                release_free_memory()
