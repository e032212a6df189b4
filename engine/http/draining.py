"""uvicorn.Server with a drain hook, and the bounded stop of background tasks, shared by
the engine and the gateway."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence
from types import FrameType

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT calls on_drain (the app turns away new
    work), then keeps listening while the requests in flight finish, so a request or a
    health probe arriving meanwhile gets the app's 503 (draining) rather than a refused
    connection; then uvicorn's own graceful shutdown: stop accepting, finish what is left,
    run the lifespan shutdown, exit. Both phases together take at most
    timeout_graceful_shutdown."""

    on_drain: Callable[[], None] | None = None
    on_listening: Callable[[], None] | None = None
    """Called once the listener is bound (after the app's startup: a model loaded)."""
    DRAIN_POLL_S = 0.1

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_listening is not None:
            self.on_listening()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        limit = self.config.timeout_graceful_shutdown
        deadline = None if limit is None else time.monotonic() + limit
        # server_state.tasks: the requests being answered (an idle keep-alive connection is
        # not one), the 503s of the drain included: they end at once.
        while (self.server_state.tasks and not self.force_exit
               and (deadline is None or time.monotonic() < deadline)):
            await asyncio.sleep(self.DRAIN_POLL_S)
        if deadline is not None:
            self.config.timeout_graceful_shutdown = max(0, round(deadline - time.monotonic()))
        await super().shutdown(sockets)

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
