"""AsyncEngine: an asyncio front over LLMEngine, whose step loop runs in its own thread.

Only the engine thread touches LLMEngine state. Event-loop code talks to it through a
command queue (add / abort) and gets outputs back through per-request asyncio queues fed
with call_soon_threadsafe, so the event loop never waits on a forward pass.

Nothing a client does can stop the engine thread: a command whose caller went away
(cancelled future) is skipped, never half-applied; a failed step fails only the request
that caused it (engine/fault_isolation.py); an unexpected error between steps fails the
requests in flight with a generic message and the loop goes on. Should the loop die anyway,
``on_fatal`` is called (the engine server exits non-zero, so a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.request import Request, RequestOutput
from engine.sampling_params import SamplingParams
from lora.adapter import LoraAdapter

log = logging.getLogger(__name__)
T = TypeVar("T")
INTERNAL_ERROR_MESSAGE = "the engine hit an internal error; the request was aborted"
"""What in-flight requests are told when the loop fails between steps (details are logged,
never sent: one request's error text must not reach another tenant)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class EngineInternalError(RuntimeError):
    """The engine failed between steps and aborted the requests in flight (a bug)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def push(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the caller's event loop is closed, so nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Streams outputs of concurrent requests; ``abort()`` frees a request's blocks before
    the next step is scheduled. Every accepted request ends with a finished output or an
    exception raised from its generate() iterator."""

    def __init__(self, engine: LLMEngine,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        """Called on the engine thread if the loop dies (never, unless there is a bug)."""
        self.fatal_error: BaseException | None = None
        """Why the loop died, if it did (None after a normal shutdown)."""
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="loragate-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig,
                    on_fatal: Callable[[BaseException], None] | None = None) -> AsyncEngine:
        return cls(LLMEngine(config), on_fatal)

    # --------------------------------------------------------------- event-loop side
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield outputs of one request as tokens arrive; the last has finished=True.

        Bad input raises ValueError before the request enters the scheduler. Closing the
        iterator early (client gone, task cancelled) aborts the request.
        """
        request = self.make_request(prompt, params, request_id, priority, lora, cache_salt)
        # aclosing: closing this iterator must close (and so abort) the inner one now.
        async with contextlib.aclosing(self.stream(request)) as outputs:
            async for out in outputs:
                yield out

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Tokenize and validate without touching engine state (ValueError for bad input)."""
        return self.engine.make_request(request_id or f"req-{next(self._ids)}", prompt,
                                        params or SamplingParams(), priority,
                                        cache_salt=cache_salt, lora=lora)

    async def stream(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        """Admit a request built by make_request() and yield its outputs (see generate())."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        finished = False
        try:
            # Inside the try: a cancellation while the add is queued still aborts it.
            await self.call(lambda: self._add(request))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                with self._lock:
                    self._streams.pop(request_id, None)
                self._enqueue(lambda: self._abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its blocks are free."""
        await self.call(lambda: self._abort(request_id))

    async def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Validate a PEFT directory off the engine thread, then register it."""
        adapter = await asyncio.to_thread(self.engine.validate_lora, name, path)
        await self.call(lambda: self.engine.add_lora(adapter))
        return adapter

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between steps; its exception is raised here."""
        return await asyncio.wrap_future(self._enqueue(fn))

    def is_alive(self) -> bool:
        """False once the engine thread has stopped (shutdown or a fatal error)."""
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        """Metrics as of the end of the last step (refreshed by the engine thread)."""
        return self._stats

    async def fresh_stats(self) -> EngineStats:
        """Metrics taken by the engine thread after every pending command was applied."""
        return await self.call(self.engine.stats)

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        if self.engine.lora is not None:
            self.engine.lora.shutdown()

    def _enqueue(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._commands.append((fn, done))
        self._wakeup.set()
        return done

    # ---------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._iterate()
                except Exception:  # a bug between steps: fail what is in flight, go on
                    log.exception("engine loop failed; aborting the requests in flight")
                    self._fail_all(EngineInternalError(INTERNAL_ERROR_MESSAGE))
        except BaseException as exc:  # _fail_all itself failed: the engine state is lost
            log.critical("engine loop died", exc_info=True)
            self.fatal_error = exc
            if self.on_fatal is not None:
                self.on_fatal(exc)
        finally:
            self._fail_streams(EngineDeadError("engine shut down"))

    def _iterate(self) -> None:
        self._apply_commands()
        if not self.engine.has_unfinished_requests():
            self._stats = self.engine.stats()
            self._wakeup.wait()
            self._wakeup.clear()
            return
        outputs = self.engine.step()
        self._stats = self.engine.stats()
        self._deliver(outputs)
        if not outputs and self.engine.last_step_idle:
            # Everything waits on something outside the step (an adapter loading).
            self._wakeup.wait(0.005)
            self._wakeup.clear()

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        if not commands:
            return
        results: list[tuple[concurrent.futures.Future[Any], Any, BaseException | None]] = []
        for fn, done in commands:
            # False: the caller cancelled while this waited (client gone): skip it whole.
            # True: the future is running now and can no longer be cancelled.
            if not done.set_running_or_notify_cancel():
                continue
            try:
                results.append((done, fn(), None))
            except Exception as exc:
                results.append((done, None, exc))
        # Stats first, so whoever wakes up from a command sees its effect.
        self._stats = self.engine.stats()
        for done, value, error in results:
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(value)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._deliver([out])

    def _add(self, request: Request) -> None:
        try:
            self.engine.add(request)
        except ValueError as exc:
            with self._lock:
                stream = self._streams.pop(request.request_id, None)
            if stream is not None:
                stream.push(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = (self._streams.pop(out.request_id, None) if out.finished
                          else self._streams.get(out.request_id))
            if stream is not None:
                stream.push(out)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort_request(request_id)
        self._fail_streams(exc)

    def _fail_streams(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.push(exc)
