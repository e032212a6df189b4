"""uvicorn.Server with a drain hook, and the bounded stop of background tasks, shared by
the engine and the gateway."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from types import FrameType

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT calls on_drain (the app turns away new
    work) before uvicorn's own graceful shutdown: stop accepting, finish in-flight
    responses (up to timeout_graceful_shutdown), run the lifespan shutdown, exit."""

    on_drain: Callable[[], None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.on_drain is not None and not self.should_exit:
            self.on_drain()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after its shutdown, which would kill the process
        # by the signal (and skip `loragate serve` stopping its engines): a drain is a clean
        # exit (status 0).
        self._captured_signals.clear()


async def stop_background(tasks: Sequence[asyncio.Task[None]], timeout_s: float) -> None:
    """Cancel the background tasks and wait at most timeout_s for them to end (their
    cleanup, such as withdrawing a registry entry, runs before the loop closes); a task that
    does not end on cancellation is named in the log and left behind, so it cannot keep a
    drained server alive."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        logging.getLogger(__name__).warning(
            "background task %s did not stop within %g s; shutting down anyway",
            task.get_name(), timeout_s)
