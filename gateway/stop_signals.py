"""StopSignals: what SIGTERM and SIGINT do to `loragate serve` while it is not serving.

uvicorn holds the signals while the gateway serves (the drain, engine/http/draining.py).
Before that, engines load; after it, they are stopped and the process exits. A signal then
must neither kill the process where it stands (leaving engines and temp files) nor turn a
clean exit into a death by signal.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

log = logging.getLogger("gateway.serve")


class StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT before the gateway listened. A BaseException, as KeyboardInterrupt:
    no `except Exception` on the way (an engine that could not start) may take it."""


class StopSignals:
    """SIGTERM and SIGINT while `serve` starts and stops (uvicorn holds them while it
    serves: the drain). Starting: they raise StoppedWhileStarting, so the caller's cleanup
    runs (engines stopped, their log directory removed) instead of the process dying where
    it stands. Once ``stopping`` is set (the cleanup began): they change nothing, as a
    second SIGTERM during the drain changes nothing, up to the process's exit (`serve` is
    the process's main: it returns only for the process to end). Only the main thread can
    hold signal handlers: elsewhere this does nothing."""

    def __init__(self) -> None:
        self.stopping = False
        self._previous: dict[int, Any] = {}
        self._deferring = False
        self._deferred: str | None = None

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A stop arriving in this block is raised when it ends (not inside it)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._deferred is not None and not self.stopping:
            raise StoppedWhileStarting(self._deferred)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle)
                              for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *_: object) -> None:
        # Once the cleanup began, the process is exiting: a signal now is ignored by the
        # kernel (SIG_IGN, which the interpreter's shutdown keeps, where it resets Python
        # handlers to the default: a signal while torch's objects are freed, up to 1.5 s,
        # would then kill it with the signal's status instead of 0). Before that (not
        # reached from serve), the previous handlers come back.
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if self.stopping else handler)

    def _handle(self, signum: int, _: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.stopping:
            log.info("%s: already stopping", name)
            return
        if self._deferring:
            self._deferred = name
            return
        raise StoppedWhileStarting(name)
