"""Work done for a client that may hang up: a request whose answer is whole (not streamed)
waits for it while its client is watched, so that a client gone mid-request aborts the
engine work instead of having it run to the end for nobody (a stream learns it when a write
fails). The gateway's whole responses and the engine's non-streamed /generate use it."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import Request

from engine.http.errors import CLIENT_CLOSED, ApiError

DISCONNECT_POLL_S = 0.25


async def next_or_disconnect(request: Request, awaitable: Any) -> Any:
    """Await while watching the client: a disconnect cancels the work (which aborts the
    request on its engine) instead of finishing it for nobody."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise ApiError(CLIENT_CLOSED, "client disconnected", code="client_closed")
    finally:
        if not task.done():  # we were cancelled (a shutdown's cut-off, a timeout)
            task.cancel()
            # Until it has ended: its generators are not closed twice at once (the
            # caller's cleanup closes the same streams).
            await asyncio.wait({task})
