"""The engine in the gateway's own process: `loragate serve` with one local instance.

LocalEngine is an EngineClient (engine/protocol.py) over an AsyncEngine, so the gateway
routes to it, retries, aborts and loads adapters exactly as it does with engine servers over
HTTP, minus the process hop and the JSON. What separate processes gave us is kept here:

- A fatal engine error (the engine loop died: a bug) does not leave the gateway hanging:
  the dead engine's streams end at once (EngineStreamBroken: the gateway retries a request
  that has no token yet, and ends the others with an error), every call raises
  EngineUnavailable meanwhile (the poller ejects the instance: 503 with Retry-After), and a
  new engine is built in the background, with the same backoff as the process supervisor
  (gateway/engine_supervisor.py). Once it answers, the poller takes it back and registers
  the adapters again.
- Adapters load only from the adapter roots, as an engine process would check them.
- Its Prometheus registry (engine/http/metrics.py) is served on the gateway's /metrics.

Client hang-ups abort requests and a failing batch is rolled back inside the AsyncEngine,
the same code as in an engine process.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from engine.adapter_roots import AdapterRoots
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.http.metrics import EngineCollector, EngineMetricsRegistry
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.protocol import (
    ChunkStream,
    EngineState,
    EngineUnavailable,
    GenerateRequest,
    LoadedAdapter,
)
from gateway.engine_supervisor import FIRST_BACKOFF_S, MAX_BACKOFF_S, STABLE_AFTER_S
from lora.adapter_info import AdapterInfo

log = logging.getLogger(__name__)
LOCAL_INSTANCE_ID = "local"


class LocalEngine:
    """One engine in this process, rebuilt when its loop dies (see the module docstring).
    Building it loads the model: construct it before serving."""

    def __init__(self, config: EngineConfig, adapter_roots: AdapterRoots,
                 instance_id: str = LOCAL_INSTANCE_ID, model_name: str | None = None) -> None:
        self.config = config
        self.adapter_roots = adapter_roots
        self.instance_id = instance_id
        self.model_name = model_name
        self.restarts = 0
        self._closed = threading.Event()
        self._backoff_s = FIRST_BACKOFF_S
        """Wait before the next rebuild: doubles while engines keep dying, back to the
        first once one stayed up for STABLE_AFTER_S."""
        self.metrics = EngineMetricsRegistry(EngineCollector(
            self._stats, self._adapters, config.max_loras,
            model_name or Path(config.model).name))
        self._engine = self._build()
        self._built_at = time.monotonic()

    # ------------------------------------------------------------ EngineClient
    async def open(self, request: GenerateRequest) -> ChunkStream:
        return await self._live().open(request)

    async def abort(self, request_id: str) -> bool:
        return await self._live().abort(request_id)

    async def state(self, cursor: int = 0) -> EngineState:
        return await self._live().state(cursor)

    async def alive(self) -> bool:
        return self._engine.is_alive()

    async def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        return await self._live().load_adapter(name, path)

    async def unload_adapter(self, name: str, digest: str | None = None) -> None:
        await self._live().unload_adapter(name, digest)

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        await self._live().pin_adapter(name, pinned)

    # ------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        self._closed.set()
        self._engine.shutdown()

    def _live(self) -> AsyncEngine:
        engine = self._engine
        if not engine.is_alive():
            raise EngineUnavailable("the in-process engine is restarting")
        return engine

    def _build(self) -> AsyncEngine:
        engine = AsyncEngine(lambda: LLMEngine(self.config), on_fatal=self._on_fatal,
                             adapter_roots=self.adapter_roots,
                             on_output=self.metrics.observe, instance_id=self.instance_id)
        engine.model_name = self.model_name or engine.model_name
        return engine

    def _on_fatal(self, error: BaseException) -> None:
        """On the dying engine thread: build the next engine on another one."""
        if time.monotonic() - self._built_at > STABLE_AFTER_S:
            self._backoff_s = FIRST_BACKOFF_S
        log.error("the in-process engine died (%s); building a new one in %.0f s",
                  type(error).__name__, self._backoff_s)
        threading.Thread(target=self._rebuild, name="loragate-engine-rebuild",
                         daemon=True).start()

    def _rebuild(self) -> None:
        while not self._closed.wait(self._backoff_s):
            self._backoff_s = min(MAX_BACKOFF_S, self._backoff_s * 2)
            started = time.monotonic()
            try:
                engine = self._build()
            except Exception:
                log.exception("building the in-process engine failed; retrying in %.0f s",
                              self._backoff_s)
                continue
            old, self._engine = self._engine, engine
            self._built_at = time.monotonic()
            old.shutdown()  # its thread is gone; this stops its adapter loader
            self.restarts += 1
            log.warning("the in-process engine was rebuilt in %.1f s (restart %d)",
                        self._built_at - started, self.restarts)
            if self._closed.is_set():
                engine.shutdown()
            return

    # ------------------------------------------------------------ metrics sources
    def _stats(self) -> EngineStats:
        return self._engine.stats()

    def _adapters(self) -> list[AdapterInfo]:
        return self._engine.last_adapters
