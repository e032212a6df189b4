"""uvicorn.Server with a drain hook, and the bounded stop of background tasks, shared by
the engine and the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
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
    run the lifespan shutdown, exit. Both phases together take at most drain_timeout_s.
    Requests still running at that deadline (or when a second SIGINT forces the exit; a
    second SIGTERM changes nothing) are handed to on_deadline, which ends them as the app
    sees fit, before uvicorn cancels whatever is left."""

    on_drain: Callable[[], None] | None = None
    on_listening: Callable[[], None] | None = None
    """Called once the listener is bound (after the app's startup: a model loaded)."""
    on_deadline: Callable[[], object] | None = None
    DRAIN_POLL_S = 0.1
    FORCED_SHUTDOWN_S = 2.0
    """How long the app's own shutdown may take after a forced exit (a second SIGINT)."""
    DEADLINE_GRACE_S = 1.0
    """How long requests ended by on_deadline get to send their last bytes."""

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        except SystemExit:
            # uvicorn logged why (a port taken since it was checked) and exits the process
            # from inside the loop; instead the server stops and its caller, seeing it never
            # started, says so in one line and cleans up (engines it started, temp files).
            self.should_exit = True
            return
        if self.started:
            freeze_startup_heap()
        if self.started and self.on_listening is not None:
            self.on_listening()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        # server_state.tasks: the requests being answered (an idle keep-alive connection is
        # not one), the 503s of the drain included: they end at once.
        while (self.server_state.tasks and not self.force_exit
               and time.monotonic() < deadline):
            await asyncio.sleep(self.DRAIN_POLL_S)
        if self.server_state.tasks and self.on_deadline is not None:
            self.on_deadline()
            grace = time.monotonic() + self.DEADLINE_GRACE_S
            while self.server_state.tasks and time.monotonic() < grace:
                await asyncio.sleep(self.DRAIN_POLL_S / 10)
        # uvicorn's own wait takes whole seconds: what is left, rounded up.
        self.config.timeout_graceful_shutdown = max(0, math.ceil(deadline - time.monotonic()))
        await super().shutdown(sockets)
        if self.force_exit:
            # uvicorn skips the app's shutdown on a forced exit: its background tasks would
            # then be cancelled as the loop closes, and the lifespan's cancellation logged
            # as a traceback. Run it, bounded: the forced exit stays quick.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.FORCED_SHUTDOWN_S):
                    await self.lifespan.shutdown()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.on_drain is not None and not self.should_exit:
            self.on_drain()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after its shutdown, which would kill the process
        # by the signal (and skip `loragate serve` stopping its engines): a drain is a clean
        # exit (status 0).
        self._captured_signals.clear()


def freeze_startup_heap() -> int:
    """Move every object alive now to the collector's permanent generation; returns how
    many that is.

    torch, transformers and the tokenizer leave some 300,000 objects that live as long as
    the process. Each collection of the oldest generation walked all of them while holding
    the GIL (a pause of the event loop and the engine thread alike), and interpreter exit
    walked them again in several collections: an idle server took seconds to exit after a
    SIGTERM. Frozen objects are skipped by both. Garbage cycles among them would never be
    freed, so a collection runs first; what startup leaves behind later is a one-time cost.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


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
