"""AsyncEngine: an asyncio front over LLMEngine, whose step loop runs in its own thread.

Only the engine thread touches LLMEngine state. Event-loop code talks to it through a
command queue and gets outputs back through per-request asyncio queues fed with
call_soon_threadsafe, so the event loop never waits on a forward pass. Every public
coroutine below is one typed command run on the engine thread between steps.

AsyncEngine is an ``EngineClient`` (engine/protocol.py): ``open()`` takes a GenerateRequest
and streams StreamChunks, as the engine's HTTP API does, so a gateway drives an engine in
its own process exactly as it drives a remote one.

Nothing a client does can stop the engine thread: a command whose caller went away
(cancelled future) is skipped, never half-applied; a failed step fails only the request
that caused it (engine/fault_isolation.py); an unexpected error between steps fails the
requests in flight with a generic message and the loop goes on. Should the loop die anyway,
``on_fatal`` is called (the engine server exits non-zero, so a supervisor restarts it; the
in-process client builds a new engine).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.adapter_roots import AdapterPathRefused, AdapterRoots
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.protocol import (
    ChunkStream,
    EngineError,
    EngineRejected,
    EngineState,
    EngineStreamBroken,
    EngineUnavailable,
    GenerateRequest,
    LoadedAdapter,
    PoolSummary,
    StreamChunk,
)
from engine.request import Request, RequestOutput
from engine.sampling_params import SamplingParams
from lora.manager import AdapterInfo

log = logging.getLogger(__name__)
T = TypeVar("T")
INTERNAL_ERROR_MESSAGE = "the engine hit an internal error; the request was aborted"
"""What in-flight requests are told when the loop fails between steps (details are logged,
never sent: one request's error text must not reach another tenant)."""
TIMED_OUT_MESSAGE = "the request passed its deadline"


class EngineDeadError(EngineUnavailable):
    """The engine thread has stopped; no request or command can be served."""


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
    exception raised from its iterator.

    ``adapter_roots``: where load_adapter() may read adapters from (None: anywhere, for
    callers that trust every path). ``on_output`` sees every output as it reaches the event
    loop (the server's latency histograms)."""

    def __init__(self, engine: LLMEngine,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 adapter_roots: AdapterRoots | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None,
                 instance_id: str = "engine-0") -> None:
        self.engine = engine
        self.config = engine.config
        self.on_fatal = on_fatal
        """Called on the engine thread if the loop dies (never, unless there is a bug)."""
        self.fatal_error: BaseException | None = None
        """Why the loop died, if it did (None after a normal shutdown)."""
        self.adapter_roots = adapter_roots
        self.on_output = on_output
        self.instance_id = instance_id
        self.model_name = engine.config.model.rstrip("/").split("/")[-1]
        self.draining = False
        """Set when the engine drains: new requests are refused, open streams finish."""
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._ended = False
        """The loop has ended: commands fail at once (nothing would ever run them)."""
        self._stats = engine.stats()
        self.last_adapters: list[AdapterInfo] = engine.list_loras()
        """Adapters as of the last command that read them (for metrics scrapes)."""
        self._thread = threading.Thread(target=self._loop, name="loragate-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig,
                    on_fatal: Callable[[BaseException], None] | None = None,
                    **kwargs: Any) -> AsyncEngine:
        return cls(LLMEngine(config), on_fatal, **kwargs)

    # ------------------------------------------------------------ the engine protocol
    async def open(self, request: GenerateRequest) -> ChunkStream:
        """Admit a request (EngineRejected for bad input, EngineUnavailable when draining
        or dead) and stream its chunks. Closing the stream early aborts the request; one
        past its deadline is aborted and ends with a "timeout" error."""
        if self.draining:
            raise EngineUnavailable("engine is draining", code="draining")
        try:
            admitted = self._make(list(request.prompt_token_ids), request.params,
                                  request.request_id, request.priority, request.adapter,
                                  request.cache_salt)
            stream = await self._admit(admitted)
        except ValueError as exc:
            raise EngineRejected(str(exc), None, 400) from None
        chunks = self._chunks(admitted.request_id, stream, request.deadline)
        return ChunkStream(chunks, lambda: self._drop(admitted.request_id))

    async def abort(self, request_id: str) -> bool:
        """End a request now; returns once its blocks are free (False: not known here)."""
        def abort() -> bool:
            known = request_id in self.engine.scheduler.requests
            self._abort(request_id)
            return known
        return await self.call(abort)

    async def state(self, cursor: int = 0) -> EngineState:
        """Load, limits, adapters and the prefix hashes published since ``cursor``."""
        return await self.call(lambda: self._state(cursor))

    async def adapters(self) -> list[AdapterInfo]:
        return await self.call(self._list_adapters)

    async def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        """Validate a PEFT directory off the engine thread (inside the adapter roots, if
        any), then register it: an adapter of the same name and other content replaces the
        registered one only when no request (running, queued or preempted) uses it, so no
        request of the new content runs on the old weights (EngineRejected, 409)."""
        resolved = path
        if self.adapter_roots is not None:
            try:
                resolved = str(self.adapter_roots.check(path))
            except AdapterPathRefused as exc:
                raise EngineRejected(str(exc), None, 400, param="path") from None
        try:
            adapter = await asyncio.to_thread(self.engine.validate_lora, name, resolved)
        except ValueError as exc:
            # Validation messages name the directory: the caller learns what is wrong with
            # the adapter, not where the engine's files are.
            raise EngineRejected(_without_paths(str(exc), path, resolved), None, 400,
                                 param="path") from None
        except OSError:
            raise EngineRejected("the adapter's files could not be read", None, 400,
                                 param="path") from None

        def add() -> None:
            held = {a.name: a.digest for a in self.engine.list_loras()}
            if held.get(adapter.name, adapter.digest) != adapter.digest:
                self.engine.remove_lora(adapter.name)  # ValueError while a request uses it
            self.engine.add_lora(adapter)
            self._list_adapters()

        try:
            await self.call(add)
        except ValueError as exc:
            raise EngineRejected(str(exc), "adapter_in_use") from None
        return LoadedAdapter(adapter.name, adapter.digest, adapter.rank)

    async def unload_adapter(self, name: str) -> None:
        """Unregister an adapter: 404 if unknown, 409 while any request uses it."""
        def remove() -> None:
            self._known_adapter(name)
            try:
                self.engine.remove_lora(name)
            except ValueError as exc:
                raise EngineRejected(str(exc), None, 409) from None
            self._list_adapters()
        await self.call(remove)

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        """Keep an adapter in its device slot (or let it go again)."""
        def pin() -> None:
            self._known_adapter(name)
            try:
                self.engine.pin_lora(name, pinned)
            except ValueError as exc:
                raise EngineRejected(str(exc), None, 404) from None
        await self.call(pin)

    # ------------------------------------------------------------ in-process API
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
        request = self._make(prompt, params or SamplingParams(), request_id, priority, lora,
                             cache_salt)
        stream = await self._admit(request)
        async with contextlib.aclosing(self._outputs(request.request_id, stream)) as outputs:
            async for out in outputs:
                yield out

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, text: str) -> list[int]:
        """Thread-safe (the tokenizer only); ValueError for an empty prompt."""
        if not text:
            raise ValueError("prompt is empty")
        return self.engine.tokenize(text)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between steps; its exception is raised here."""
        return await asyncio.wrap_future(self._enqueue(fn))

    @property
    def in_flight(self) -> int:
        """Requests whose stream is open."""
        with self._lock:
            return len(self._streams)

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

    # ------------------------------------------------------------ event-loop side
    def _make(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
              priority: int, lora: str | None, cache_salt: str | None) -> Request:
        """Tokenize and validate without touching engine state (ValueError for bad input)."""
        return self.engine.make_request(request_id or self.new_request_id(), prompt, params,
                                        priority, cache_salt=cache_salt, lora=lora)

    async def _admit(self, request: Request) -> _Stream:
        """Register the request's output queue and add it on the engine thread; ValueError
        (duplicate id, a refusal by the scheduler) or EngineDeadError if it did not enter."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        try:
            await self.call(lambda: self.engine.add(request))
        except ValueError:  # refused: it never entered (the id may be another request's)
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        except BaseException:  # cancelled: the add may have run all the same
            self._drop(request_id)
            raise
        return stream

    async def _outputs(self, request_id: str, stream: _Stream, deadline: float | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of an admitted request; closing early (or the deadline, a unix time,
        passing: TimeoutError) aborts it."""
        finished = False
        when = None if deadline is None else \
            asyncio.get_running_loop().time() + deadline - time.time()
        try:
            while True:
                async with asyncio.timeout_at(when):
                    item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if self.on_output is not None:
                    self.on_output(item)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._drop(request_id)

    async def _chunks(self, request_id: str, stream: _Stream, deadline: float | None
                      ) -> AsyncGenerator[StreamChunk, None]:
        """Outputs as StreamChunks; a failure of the request is its last chunk, the engine
        dying is EngineStreamBroken."""
        reported = 0  # logprob entries already sent
        usage = (0, 0)
        try:
            async with contextlib.aclosing(self._outputs(request_id, stream, deadline)) as outs:
                async for out in outs:
                    usage = (len(out.prompt_token_ids), len(out.token_ids))
                    logprobs = None if out.logprobs is None else out.logprobs[reported:]
                    reported = len(out.token_ids)
                    yield StreamChunk(
                        request_id, out.delta_token_ids, out.delta_text, *usage,
                        (out.finish_reason or "stop") if out.finished else None, logprobs,
                        None if out.error is None else EngineError(out.error))
        except EngineInternalError as exc:
            yield StreamChunk.failed(request_id, EngineError(str(exc)), *usage)
        except TimeoutError:
            yield StreamChunk.failed(request_id, EngineError(TIMED_OUT_MESSAGE, "timeout"),
                                     *usage)
        except EngineDeadError as exc:
            raise EngineStreamBroken(str(exc)) from None

    def _drop(self, request_id: str) -> None:
        """Stop listening to a request and abort it (its caller is gone)."""
        with self._lock:
            self._streams.pop(request_id, None)
        self._enqueue(lambda: self._abort(request_id))

    def _enqueue(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._ended:
                done.set_exception(EngineDeadError("the engine thread is not running"))
                return done
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

    def _list_adapters(self) -> list[AdapterInfo]:
        self.last_adapters = self.engine.list_loras()
        return self.last_adapters

    def _known_adapter(self, name: str) -> None:
        if name not in {a.name for a in self._list_adapters()}:
            raise EngineRejected(f"unknown adapter {name!r}", None, 404)

    def _state(self, cursor: int) -> EngineState:
        llm, config = self.engine, self.engine.config
        stats = llm.stats()
        return EngineState(
            instance_id=self.instance_id, model=self.model_name, draining=self.draining,
            in_flight=self.in_flight, num_running=stats.num_running,
            num_waiting=stats.num_waiting, num_swapped=stats.num_swapped,
            kv_blocks_used=stats.kv_blocks_used, kv_blocks_total=stats.kv_blocks_total,
            max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
            max_num_seqs=config.max_num_seqs, block_size=config.block_size,
            publish_every=config.prefix_publish_every, max_model_len=llm.max_model_len,
            max_request_tokens=min(llm.max_model_len, llm.kv.max_tokens_per_request()),
            prefix_hit_rate=stats.prefix_cache.hit_rate,
            kv_pools={name: PoolSummary(p.used_blocks, p.cached_blocks, p.evictions,
                                        p.hit_rate) for name, p in stats.kv_pools.items()},
            adapters=self._list_adapters(), prefix=llm.publish_prefixes(cursor))

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


def _without_paths(message: str, *paths: str) -> str:
    """message with every given path (longest first: one may contain another) as <path>."""
    for path in sorted({p for p in paths if p}, key=len, reverse=True):
        message = message.replace(repr(path), "<path>").replace(path, "<path>")
    return message
