"""The engine's preparing thread: where requests whose making may take long (a grammar to
compile, text to tokenize, bad words to spell) are made, off the event loop.

One thread, so that a flood of large grammars takes at most one core from the engine's steps
(on a 2-core host, a cached request beside 12 large compiles took 0.84 s with one, 1.39 s with
two); its own, not the loop's default pool, which serves other work of the process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine.engine_thread import EngineDeadError

T = TypeVar("T")


class PreparingThread:
    """Runs work off the event loop; an engine error, never a bare cancellation, when the
    engine shuts down first (a gateway retries an engine error elsewhere)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loragate-prepare")

    async def run(self, work: Callable[[], T]) -> T:
        """work() on the thread. EngineDeadError when the engine shuts down before it ran
        (shutdown cancels queued work: the caller was not cancelled) or has shut down."""
        try:
            future = asyncio.get_running_loop().run_in_executor(self._pool, work)
        except RuntimeError:  # the pool refuses work after shutdown
            raise EngineDeadError("the engine has shut down") from None
        try:
            return await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller's own cancellation
            raise EngineDeadError("the engine shut down while the request was being "
                                  "prepared") from None

    def shutdown(self) -> None:
        """Refuse new work and cancel what is queued (what runs finishes)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
