"""Relaying a dispatched request's engine chunks (one stream per prompt of a batch) to its
client: one whole response, or SSE events ending with ``data: [DONE]`` (an engine failure
after the stream started is an ``error`` event carrying only this request's own error; a
whole response that ends in one gets the status of its code, engine/protocol.py
ERROR_STATUS). Every float sent is finite, as JSON requires.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi.sse import EventSourceResponse
from starlette.types import Receive, Scope, Send

from engine.http.errors import ERROR_CODE_KEY, ApiError
from engine.protocol import EngineError, StreamChunk
from gateway.batch_stream import BatchStream
from gateway.job import Job
from gateway.openai_format import ResponseFormatter
from gateway.openai_protocol import StreamUsage
from gateway.service import Gateway


class ClosingStream(EventSourceResponse):
    """An SSE response that closes its generators and settles its claim when it ends,
    however it ends: a client that leaves while an event is being sent would otherwise
    leave them suspended (engine requests running, claim held) until garbage collection,
    and a response that never started would never settle."""

    def __init__(self, events: AsyncGenerator[bytes, None], streams: BatchStream,
                 settle: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(events, headers=headers)
        self._closers = (events.aclose, streams.aclose)
        self._settle = settle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                for close in self._closers:
                    await close()
            finally:
                self._settle()


async def collect(gateway: Gateway, jobs: list[Job], streams: BatchStream,
                  fmt: ResponseFormatter) -> dict[str, Any]:
    timer = _Timer(gateway, jobs[0])
    async with contextlib.aclosing(aiter(streams)) as chunks:
        async for index, chunk in chunks:
            timer.tick(chunk)
            if chunk.error is not None:
                error = chunk.error
                raise ApiError(error.status, error.message, code=error.code, headers=(
                    {"Retry-After": str(gateway.config.retry_after_s)}
                    if error.status in (429, 503) else None))
            fmt.add(chunk, index)
    timer.done()
    return fmt.final()


async def sse(gateway: Gateway, jobs: list[Job], streams: BatchStream, fmt: ResponseFormatter,
              usage: StreamUsage, scope: Scope | None = None) -> AsyncGenerator[bytes, None]:
    """The SSE events of a streamed request. An error event's code is left in ``scope``
    (ERROR_CODE_KEY): the response, 200 since its first byte, is counted with it."""
    status = "200"
    job = jobs[0]
    try:
        timer = _Timer(gateway, job)
        async with contextlib.aclosing(aiter(streams)) as chunks:
            async for index, chunk in chunks:
                timer.tick(chunk)
                if chunk.error is not None:
                    status = str(chunk.error.status)
                    told = _own_error(chunk.error)
                    if scope is not None:
                        scope[ERROR_CODE_KEY] = told["code"]
                    yield sse_event({"error": told})
                    break
                for event in fmt.stream_events(chunk, usage, index):
                    yield sse_event(event)
        timer.done()
        if usage != "none" and status == "200":
            yield sse_event(fmt.usage_event())
        yield SSE_DONE
    except (asyncio.CancelledError, GeneratorExit):
        status = str(gateway.cancelled_status())
        raise
    finally:  # the claim is settled by the response (ClosingStream), which closes this
        gateway.metrics.requests.labels(job.endpoint, status, job.adapter or "base",
                                        job.instance_id or "none").inc()


def _own_error(error: EngineError) -> dict[str, str | None]:
    """The error event of this request's stream: its own message, type, param and code only
    (OpenAI's error schema, as a whole response's error has it; nothing else an engine chunk
    might carry is passed on)."""
    return {"message": error.message, "type": error.type, "param": error.param,
            "code": error.code or "engine_error"}


SSE_DONE = b"data: [DONE]\n\n"
"""The last event of every stream, after an error event too."""


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE event of a JSON payload."""
    # allow_nan=False: a bare NaN is not JSON; the formatter makes every float finite, so
    # this fails loudly rather than send what clients cannot parse.
    return b"data: " + json.dumps(payload, separators=(",", ":"), allow_nan=False
                                  ).encode() + b"\n\n"


class _Timer:
    """TTFT / ITL / E2E as the client sees them (from the gateway's arrival time)."""

    def __init__(self, gateway: Gateway, job: Job) -> None:
        self.metrics = gateway.metrics
        self.job = job
        self.arrival = job.arrival
        self.last: float | None = None

    def tick(self, chunk: StreamChunk) -> None:
        if not chunk.delta_token_ids:
            return
        now = time.monotonic()
        if self.last is None:
            # A whole response's chunks arrive together at the end: its first token's time
            # was noted when the gateway got it (gateway/service.py _relay).
            first = self.job.first_token_at or now
            self.metrics.ttft.observe(first - self.arrival)
            self.job.first_token_at = first
        elif not self.job.whole:  # gaps between held chunks mean nothing to the client
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def done(self) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
