"""The one thread on which a replica process (and each rank actor) runs its torch work.

PyTorch's CPU build runs each op's intra-op parallelism on OpenMP, and OpenMP keeps a pool
of worker threads for every thread that calls into it (GNU libgomp: one team per calling
thread, whose workers spin for a while after each parallel region before they sleep). A
replica that loaded its model on Serve's constructor thread and ran its batches on asyncio's
default executor owned two such pools on the same cores. Measured on the embedded tiny-flux
(16 steps, 64x64 pixels, 2 torch threads, 2 cores; ``bench/overhead.py`` and a plain loop):
one batch took 180-240 ms when one thread ran every batch, 350-430 ms once a second live thread
had also run torch work; in the served replica its denoise was 12-43 ms slower than the same
batch in-process. So everything of a replica that runs torch (load, warmup, adapter checks,
batches) goes through one :class:`ComputeThread`.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from concurrent.futures import Future


class ComputeThread:
    """One long-lived worker thread; ``call`` runs a function on it and waits, ``run`` awaits
    it from an event loop. Calls run one after another in submission order, in the caller's
    context (its contextvars: Serve's request id in log lines). The thread is a daemon: a
    process that exits while it is stuck (in a collective of a broken group) is not held up
    by it. Calling ``call`` from the thread itself would deadlock: functions run here must not
    call back into it."""

    def __init__(self, name: str, torch_threads: int | None = None):
        """``torch_threads``: ``torch.set_num_threads`` applied on the thread itself (OpenMP's
        thread count is per calling thread); None keeps torch's default."""
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()
        if torch_threads:
            self.call(_set_torch_threads, torch_threads)

    def _serve(self) -> None:
        while True:
            future, context, fn, args, kwargs = self._work.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = context.run(fn, *args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _submit(self, fn, args, kwargs) -> Future:
        future: Future = Future()
        self._work.put((future, contextvars.copy_context(), fn, args, kwargs))
        return future

    def call(self, fn, /, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the thread; blocks until it returns, raises what it raises."""
        return self._submit(fn, args, kwargs).result()

    async def run(self, fn, /, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the thread, awaited. Cancelling the await does not stop a
        call already running (as with ``asyncio.to_thread``): stop it through its own checks."""
        return await asyncio.wrap_future(self._submit(fn, args, kwargs))


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
