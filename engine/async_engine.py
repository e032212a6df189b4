"""AsyncEngine: an asyncio front over LLMEngine, whose step loop runs in its own thread
(engine/engine_thread.py). Every public coroutine below is one typed command run on the
engine thread between steps.

AsyncEngine is an ``EngineClient`` (engine/protocol.py): ``open()`` takes a GenerateRequest
and streams StreamChunks, as the engine's HTTP API does, so a gateway drives an engine in
its own process exactly as it drives a remote one.

Nothing a client does can stop the engine thread: a failed step fails only the request that
caused it (engine/fault_isolation.py), an error between steps only the requests in flight.
Should the loop die anyway, ``on_fatal`` is called (the engine server exits non-zero, so a
supervisor restarts it; the in-process client builds a new engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from engine.adapter_commands import AdapterChanged, AdapterCommands, changed_message
from engine.adapter_roots import AdapterRoots
from engine.config import EngineConfig
from engine.engine_thread import (
    EngineDeadError,
    EngineInternalError,
    EngineStopping,
    EngineThread,
    OutputStream,
)
from engine.invalid_field import field_of
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.preparing_thread import PreparingThread
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
from lora.adapter_info import AdapterInfo

T = TypeVar("T")
TIMED_OUT_MESSAGE = "the request passed its deadline"
STOPPED_MESSAGE = "the engine is shutting down: the request did not finish before it stopped"


class AsyncEngine:
    """Streams outputs of concurrent requests; ``abort()`` frees a request's blocks before
    the next step is scheduled. Every accepted request ends with a finished output or an
    exception raised from its iterator.

    ``adapter_roots``: where load_adapter() may read adapters from (None: anywhere, for
    callers that trust every path). ``on_output`` sees every output as it reaches the event
    loop (the server's latency histograms)."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 on_fatal: Callable[[BaseException], None] | None = None,
                 adapter_roots: AdapterRoots | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None,
                 instance_id: str = "engine-0") -> None:
        # Built on the engine thread (see engine/engine_thread.py) unless given built.
        built = engine
        self._thread = EngineThread((lambda: built) if isinstance(built, LLMEngine) else built,
                                    on_fatal)
        self.engine = engine = self._thread.engine
        self.config = engine.config
        self.adapter_roots = adapter_roots
        self.on_output = on_output
        self.instance_id = instance_id
        self.model_name = engine.config.model.rstrip("/").split("/")[-1]
        self.draining = False
        """Set when the engine drains: new requests are refused, open streams finish."""
        self._ids = itertools.count()
        # A flood of slow compiles waits there while cached requests go straight in.
        self._preparing = PreparingThread()
        self._adapters = AdapterCommands(engine, self.call)

    @classmethod
    def from_config(cls, config: EngineConfig,
                    on_fatal: Callable[[BaseException], None] | None = None,
                    **kwargs: Any) -> AsyncEngine:
        return cls(lambda: LLMEngine(config), on_fatal, **kwargs)

    # ------------------------------------------------------------ the engine protocol
    async def open(self, request: GenerateRequest) -> ChunkStream:
        """Admit a request (EngineRejected for bad input, EngineUnavailable when draining
        or dead) and stream its chunks. Closing the stream early aborts the request; one
        past its deadline is aborted and ends with a "timeout" error."""
        if self.draining:
            raise EngineUnavailable("engine is draining", code="draining")
        try:
            if request.adapter is not None and request.adapter_digest is not None:
                # Early (a request for weights not here is not prepared for nothing); the
                # check that holds is the one at admission (_admit).
                self._adapters.check_digest(request.adapter, request.adapter_digest)
            admitted = await self._make_off_loop(
                list(request.prompt_token_ids), request.params, request.request_id,
                request.priority, request.adapter, request.cache_salt, request.tenant)
            if self.draining:  # began while it was prepared
                raise EngineUnavailable("engine is draining", code="draining")
            stream = await self._admit(admitted, request.adapter_digest)
        except AdapterChanged as exc:
            raise EngineRejected(str(exc), "adapter_changed") from None
        except ValueError as exc:
            if request.adapter is not None and request.adapter_digest is not None and \
                    self._adapters.digest_of(request.adapter) != request.adapter_digest:
                # Unloaded while it was prepared: what the caller must hear is that.
                raise EngineRejected(changed_message(request.adapter), "adapter_changed") from None
            raise EngineRejected(str(exc), None, 400, param=field_of(exc)) from None
        chunks = self._chunks(admitted.request_id, stream, request.deadline)
        return ChunkStream(chunks, lambda: self._drop(admitted.request_id))

    async def abort(self, request_id: str) -> bool:
        """End a request now; returns once its blocks are free (False: not known here)."""
        def abort() -> bool:
            known = request_id in self.engine.scheduler.requests
            self._abort(request_id)
            return known
        return await self.call(abort)

    def cut_off(self) -> int:
        """End every request in flight, waiting or running, with a "shutting_down" error
        (its stream's last chunk) and free its blocks: what the server does with the
        requests its drain did not see finish. Returns how many streams were open."""
        count = self._thread.num_streams
        self._thread.fail_in_flight(EngineStopping(STOPPED_MESSAGE))
        return count

    async def state(self, cursor: int = 0) -> EngineState:
        """Load, limits, adapters and the prefix hashes published since ``cursor``."""
        return await self.call(lambda: self._state(cursor))

    async def adapters(self) -> list[AdapterInfo]:
        return await self.call(self._adapters.listed)

    async def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        """See AdapterCommands.load (inside ``adapter_roots``, if any)."""
        return await self._adapters.load(name, path, self.adapter_roots)

    async def unload_adapter(self, name: str, digest: str | None = None) -> None:
        """See AdapterCommands.unload."""
        await self._adapters.unload(name, digest)

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        """See AdapterCommands.pin."""
        await self._adapters.pin(name, pinned)

    @property
    def last_adapters(self) -> list[AdapterInfo]:
        """Adapters as of the last command that read them (for metrics scrapes)."""
        return self._adapters.last

    # ------------------------------------------------------------ in-process API
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora: str | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield outputs of one request as tokens arrive; the last has finished=True.

        Bad input raises ValueError before the request enters the scheduler. Closing the
        iterator early (client gone, task cancelled) aborts the request.
        """
        request = await self._make_off_loop(prompt, params or SamplingParams(), request_id,
                                            priority, lora, cache_salt, tenant)
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
        return self.engine.requests.tokenize(text)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between steps; its exception is raised here."""
        return await asyncio.wrap_future(self._thread.submit(fn))

    @property
    def in_flight(self) -> int:
        """Requests whose stream is open."""
        return self._thread.num_streams

    def is_alive(self) -> bool:
        """False once the engine thread has stopped (shutdown or a fatal error)."""
        return self._thread.is_alive()

    @property
    def fatal_error(self) -> BaseException | None:
        """Why the engine thread died, if it did (None while alive or after shutdown)."""
        return self._thread.fatal_error

    def stats(self) -> EngineStats:
        """Metrics as of the end of the last step (refreshed by the engine thread)."""
        return self._thread.stats

    async def fresh_stats(self) -> EngineStats:
        """Metrics taken by the engine thread after every pending command was applied."""
        return await self.call(self.engine.stats)

    def shutdown(self) -> None:
        self._thread.stop()
        self._preparing.shutdown()
        self.engine.requests.close()
        if self.engine.lora is not None:
            self.engine.lora.shutdown()
        if self.engine.kv_events is not None:  # after the loop: no step flushes any more
            self.engine.kv_events.close()

    # ------------------------------------------------------------ event-loop side
    def _make(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
              priority: int, lora: str | None, cache_salt: str | None,
              arrival: float | None = None) -> Request:
        """Tokenize and validate without touching engine state (ValueError for bad input)."""
        return self.engine.requests.make_request(request_id or self.new_request_id(), prompt,
                                                 params, priority, arrival, cache_salt, lora)

    async def _make_off_loop(self, prompt: str | list[int], params: SamplingParams,
                             request_id: str | None, priority: int, lora: str | None,
                             cache_salt: str | None, tenant: str | None = None) -> Request:
        """_make, on the preparing thread when it may take long (a grammar to compile, text
        to tokenize: xgrammar and the fast tokenizers release the GIL meanwhile; on the event
        loop they would stall every other request of this process), else here at once: a
        request whose grammar is cached does not queue behind another's compile. On the
        thread, in ``tenant``'s turn (PreparingThread)."""
        # Arrived now: a wait for the preparing thread counts in its queue time and TTFT.
        make = functools.partial(self._make, prompt, params, request_id, priority, lora,
                                 cache_salt, time.monotonic())
        if not self.engine.requests.takes_long(prompt, params, cache_salt):
            request = make()
        else:
            request = await self._preparing.run(make, tenant)
        request.tenant = tenant  # its share of the running batch (Scheduler)
        return request

    async def tokenize_off_loop(self, text: str, tenant: str | None = None) -> list[int]:
        """tokenize() on the preparing thread, in ``tenant``'s turn (a long text takes a
        while)."""
        return await self._preparing.run(functools.partial(self.tokenize, text), tenant)

    async def _admit(self, request: Request, adapter_digest: str | None = None
                     ) -> OutputStream:
        """Register the request's output queue and add it on the engine thread; ValueError
        (duplicate id, a refusal by the scheduler, AdapterChanged: its adapter does not hold
        ``adapter_digest`` now) or EngineDeadError if it did not enter."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")
        request_id = request.request_id
        stream = OutputStream(asyncio.get_running_loop(), asyncio.Queue())
        self._thread.register(request_id, stream)

        def add() -> None:
            # Checked in the same engine-thread call as the add: no load can come between.
            if adapter_digest is not None and request.lora_name is not None:
                self._adapters.check_digest(request.lora_name, adapter_digest)
            self.engine.add(request)
        try:
            await self.call(add)
        except ValueError:  # refused: it never entered (the id may be another request's)
            self._thread.unregister(request_id)
            raise
        except BaseException:  # cancelled: the add may have run all the same
            self._drop(request_id)
            raise
        return stream

    async def _outputs(self, request_id: str, stream: OutputStream, deadline: float | None = None
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

    async def _chunks(self, request_id: str, stream: OutputStream, deadline: float | None
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
                        None if out.error is None else EngineError(
                            out.error, out.error_code or "engine_error"),
                        out.prompt_logprobs, out.num_cached_tokens, out.stop_reason)
        except EngineInternalError as exc:
            yield StreamChunk.failed(request_id, EngineError(str(exc)), *usage)
        except TimeoutError:
            yield StreamChunk.failed(request_id, EngineError(TIMED_OUT_MESSAGE, "timeout"),
                                     *usage)
        except EngineStopping:
            yield StreamChunk.failed(request_id, EngineError(STOPPED_MESSAGE, "shutting_down"),
                                     *usage)
        except EngineDeadError as exc:
            raise EngineStreamBroken(str(exc)) from None

    def _drop(self, request_id: str) -> None:
        """Stop listening to a request and abort it (its caller is gone)."""
        self._thread.unregister(request_id)
        self._thread.submit(lambda: self._abort(request_id))

    # ---------------------------------------------------------------- engine thread
    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._thread.deliver([out])

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
            adapters=self._adapters.listed(), prefix=llm.publish_prefixes(cursor),
            kv_events=None if config.kv_events_endpoint is None else
            (config.kv_events_endpoint, config.kv_events_replay_endpoint),
            sampling_defaults=llm.sampling_defaults)

