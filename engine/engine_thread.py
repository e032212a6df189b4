"""EngineThread: the one thread that touches an LLMEngine, stepping it and running commands
between steps.

Event-loop code hands it commands (callables run between steps, answered through futures)
and registers a stream per request; each step's outputs are pushed into those streams with
call_soon_threadsafe, so no event loop ever waits on a forward pass.

The engine is built on this thread too, given a function that builds it: torch's OpenMP
runtime (libgomp) keeps a team of worker threads per thread that runs parallel regions, and
with two teams on a small host (one left by building on the caller's thread, one for the
steps) it stops spinning between regions, which made every step of SmolLM2 on 2 cores about
60% slower (21 -> 33 ms per decode step).

Invariants: only this thread reads or changes LLMEngine state once it started; a command
whose caller went away (cancelled future) is skipped whole, never half-applied; an error
between steps fails the requests in flight with a generic message (details are logged, never
sent: one request's error text must not reach another tenant) and the loop goes on. Should
the loop die anyway, ``on_fatal`` is called and every later command fails at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.protocol import EngineUnavailable
from engine.request import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
INTERNAL_ERROR_MESSAGE = "the engine hit an internal error; the request was aborted"


class EngineDeadError(EngineUnavailable):
    """The engine thread has stopped; no request or command can be served."""


class EngineInternalError(RuntimeError):
    """The engine failed between steps and aborted the requests in flight (a bug)."""


class EngineStopping(RuntimeError):
    """The engine's server stopped before the request finished: its drain ran out of time."""


@dataclass
class OutputStream:
    """Where one request's outputs (or the exception that ends it) are delivered."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def push(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the caller's event loop is closed, so nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineThread:
    """Steps ``engine`` while it has work, runs submitted commands between steps and
    delivers outputs to the registered streams (a finished request's stream is dropped)."""

    def __init__(self, build: Callable[[], LLMEngine],
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """Start the thread, build the engine on it and return once it is built (raising
        what building raised)."""
        self.on_fatal = on_fatal
        """Called on the engine thread if the loop dies (never, unless there is a bug)."""
        self.fatal_error: BaseException | None = None
        """Why the loop died, if it did (None after a normal shutdown)."""

        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._streams: dict[str, OutputStream] = {}
        self._lock = threading.Lock()  # guards _commands, _streams, _ended
        self._wakeup = threading.Event()
        self._stopping = False
        self._ended = False
        """The loop has ended: commands fail at once (nothing would ever run them)."""
        built = concurrent.futures.Future[LLMEngine]()
        self._thread = threading.Thread(target=self._run, args=(build, built),
                                        name="loragate-engine", daemon=True)
        self._thread.start()
        built.result()  # the engine, or what building it raised

    # ------------------------------------------------------------ any thread
    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run fn on the engine thread before its next step; the future holds its result."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._ended:
                done.set_exception(EngineDeadError("the engine thread is not running"))
                return done
            self._commands.append((fn, done))
        self._wakeup.set()
        return done

    def register(self, request_id: str, stream: OutputStream) -> None:
        """Listen to a request's outputs; ValueError if its id already has a stream."""
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def fail_in_flight(self, exc: BaseException) -> concurrent.futures.Future[None]:
        """End each open stream with ``exc`` now, and abort every request, waiting or
        running, between two steps on the engine thread (which frees their blocks, and ends
        the stream of any request opened meanwhile). The streams end at once, not after the
        step in progress: a server at its drain deadline has a second or so left to send
        their last chunks, and a CPU step can take longer."""
        self._fail_streams(exc)
        return self.submit(lambda: self._fail_all(exc))

    def stop(self, timeout: float = 30) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=timeout)

    # ------------------------------------------------------------ engine thread only
    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = (self._streams.pop(out.request_id, None) if out.finished
                          else self._streams.get(out.request_id))
            if stream is not None:
                stream.push(out)

    def _run(self, build: Callable[[], LLMEngine],
             built: concurrent.futures.Future[LLMEngine]) -> None:
        try:
            engine = build()
        except BaseException as exc:
            with self._lock:
                self._ended = True
            built.set_exception(exc)
            return
        self.engine: LLMEngine = engine
        self.stats: EngineStats = engine.stats()
        """Metrics as of the end of the last step or command batch."""
        built.set_result(engine)
        self._loop()

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
            with self._lock:
                self._ended = True
                commands, self._commands = self._commands, []
            for _, done in commands:
                if done.set_running_or_notify_cancel():
                    done.set_exception(EngineDeadError("the engine thread is not running"))
            self._fail_streams(EngineDeadError("engine shut down"))

    def _iterate(self) -> None:
        self._apply_commands()
        if not self.engine.has_unfinished_requests():
            self.stats = self.engine.stats()
            self._wakeup.wait()
            self._wakeup.clear()
            return
        outputs = self.engine.step()
        self.stats = self.engine.stats()
        self.deliver(outputs)
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
        self.stats = self.engine.stats()
        for done, value, error in results:
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(value)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort_request(request_id)
        self._fail_streams(exc)

    def _fail_streams(self, exc: BaseException) -> None:
        # Safe from any thread (fail_in_flight calls it from the event loop's): the map is
        # swapped under the lock, and push hands the item to each stream's own loop.
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.push(exc)
