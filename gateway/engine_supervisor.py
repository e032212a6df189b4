"""Restarts local engine processes that exit while `loragate serve` runs.

An engine exits on its own only when something is badly wrong (its engine loop died: exit
status 70, or the process was killed). Meanwhile the gateway ejects it (its polls and
requests fail) and routes to the others; once the restarted engine answers /health, the
gateway's poller takes it back and registers the adapters again. Restarts back off
exponentially (1 s, 2 s, 4 s ... up to 60 s) while an engine keeps dying, and the backoff
resets once a restarted engine has stayed up for STABLE_AFTER_S.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.serve import EngineProcess

log = logging.getLogger(__name__)
CHECK_EVERY_S = 0.5
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
STABLE_AFTER_S = 120.0


@dataclass
class _Restarts:
    backoff_s: float = FIRST_BACKOFF_S
    next_at: float | None = None
    """When the exited engine may be started again (None: it is running)."""
    started_at: float = 0.0
    count: int = 0


class EngineSupervisor:
    """Watches engine processes from a background thread and restarts the ones that exit
    (see the module docstring). stop() before stopping the engines on purpose."""

    def __init__(self, engines: list[EngineProcess]) -> None:
        self.engines = engines
        self._state = {id(e): _Restarts(started_at=time.monotonic()) for e in engines}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-supervisor",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def restarts(self, engine: EngineProcess) -> int:
        return self._state[id(engine)].count

    def _run(self) -> None:
        while not self._stopped.wait(CHECK_EVERY_S):
            for engine in self.engines:
                self._check(engine, self._state[id(engine)], time.monotonic())

    def _check(self, engine: EngineProcess, state: _Restarts, now: float) -> None:
        code = engine.process.poll()
        if code is None:
            if state.next_at is None and now - state.started_at > STABLE_AFTER_S:
                state.backoff_s = FIRST_BACKOFF_S
            return
        if state.next_at is None:  # just found it dead
            state.next_at = now + state.backoff_s
            log.error("engine %s exited with status %s; restarting it in %.0f s. Its log "
                      "ends with:\n%s", engine.url, code, state.backoff_s, engine.log_tail())
            return
        if now < state.next_at or self._stopped.is_set():
            return
        engine.respawn()
        state.count += 1
        state.started_at, state.next_at = now, None
        state.backoff_s = min(MAX_BACKOFF_S, state.backoff_s * 2)
        log.warning("engine %s restarted (restart %d)", engine.url, state.count)
