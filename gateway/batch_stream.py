"""The chunks of a batch's engine streams as one stream of (choice index, chunk).

A /v1/completions batch of prompts runs as one engine request per prompt, each routed on
its own (prompts of one batch often share a prefix, so prefix-aware routing tends to put
them together). Their chunks interleave in arrival order. Each stream is read by its own
task, which owns it: closing the batch cancels the tasks, and each closes its stream on the
way out (aborting a request still running), so no stream is closed while being read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from engine.protocol import ChunkStream, StreamChunk

_DONE = object()


class BatchStream:
    """One iterator over several ChunkStreams; a stream that raises ends the batch with
    that exception. A batch of one reads its stream directly (no task, no queue)."""

    def __init__(self, streams: list[ChunkStream]) -> None:
        self.streams = streams
        self._tasks: list[asyncio.Task[None]] = []

    def __aiter__(self) -> AsyncGenerator[tuple[int, StreamChunk], None]:
        return self._single() if len(self.streams) == 1 else self._merged()

    async def _single(self) -> AsyncGenerator[tuple[int, StreamChunk], None]:
        async with contextlib.aclosing(self.streams[0]) as stream:
            async for chunk in stream:
                yield 0, chunk

    async def _merged(self) -> AsyncGenerator[tuple[int, StreamChunk], None]:
        queue: asyncio.Queue[tuple[int, StreamChunk] | BaseException | object] = \
            asyncio.Queue()

        async def pump(index: int, stream: ChunkStream) -> None:
            try:
                async with contextlib.aclosing(stream):
                    async for chunk in stream:
                        queue.put_nowait((index, chunk))
            except Exception as exc:
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(_DONE)

        self._tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        running = len(self._tasks)
        try:
            while running:
                item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item  # type: ignore[misc]
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """End every stream (those not read yet too: their requests are aborted)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if not self._tasks:
            for stream in self.streams:
                await stream.aclose()
