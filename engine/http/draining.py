"""uvicorn.Server with a drain hook, shared by the engine and the gateway."""

from __future__ import annotations

from collections.abc import Callable
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
