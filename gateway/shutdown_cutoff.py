"""ShutdownCutoff: how requests still running when the drain runs out of time end.

Without it uvicorn cancels them: a stream stops mid-way with no error event and no
``[DONE]`` (a client cannot tell a cut from a finished answer), its access line says the
client left (499), and the cancellation prints tracebacks. With it, ``cut_off()`` (called
at the drain deadline, or on a forced exit) cancels each request's task itself, and the
request then ends as a shutdown:

- not started: a 503 ``shutting_down`` error (with ``Connection: close``);
- an SSE stream: an error event (code ``shutting_down``), then ``data: [DONE]``; or, where
  the route left its own ending in the scope (``CUT_TAIL_KEY``: the Responses API's named
  events), that ending;
- any other started body: ended where it is (its length or framing tells the client).

Its cost per request is a set insertion: no task, no wait (cancelling the request's own
task reaches wherever it waits, the engine stream included, whose cleanup aborts the
engine request as a hang-up would).
"""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.http.errors import ERROR_CODE_KEY, error_body
from gateway.openai_stream import SSE_DONE, sse_event

SHUTTING_DOWN = "shutting_down"
MESSAGE = "the server is shutting down: the request did not finish before it stopped"
CUT_TAIL_KEY = "loragate.cut_tail"
"""Where a streaming route leaves, in the ASGI scope, a callable giving the bytes that end its
stream when it is cut (given the error body); unset: chat's error event and ``[DONE]``."""


class ShutdownCutoff:
    """See the module docstring. ``wrap`` is the middleware factory (app.add_middleware(
    cutoff.wrap)); this object, which the server's deadline hook reaches, is its state."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[object]] = set()
        self._cut: set[asyncio.Task[object]] = set()

    def wrap(self, app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            await self._call(app, scope, receive, send)
        return middleware

    def cut_off(self) -> int:
        """End every request still running (see the module docstring); how many."""
        for task in self._running - self._cut:
            self._cut.add(task)
            task.cancel(SHUTTING_DOWN)
        return len(self._cut)

    async def _call(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        if scope["type"] != "http" or task is None:
            await app(scope, receive, send)
            return
        started = ended = event_stream = False

        async def tracked(message: Message) -> None:
            nonlocal started, ended, event_stream
            if message["type"] == "http.response.start":
                started = True
                event_stream = any(name.lower() == b"content-type"
                                   and value.startswith(b"text/event-stream")
                                   for name, value in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        self._running.add(task)
        try:
            await app(scope, receive, tracked)
        except asyncio.CancelledError:
            if task not in self._cut:
                raise  # a hang-up, or uvicorn's own cancellation: not ours to answer
            task.uncancel()
            scope[ERROR_CODE_KEY] = SHUTTING_DOWN  # the response metrics' code label
            if not started:  # another replica can take it: say so, as a drain's 503 does
                await JSONResponse(error_body(503, MESSAGE, code=SHUTTING_DOWN),
                                   status_code=503,
                                   headers={"Retry-After": "1", "Connection": "close"},
                                   )(scope, receive, send)
            elif not ended:
                tail = b""
                if event_stream:  # as a stream that failed ends
                    tail = scope.get(CUT_TAIL_KEY, _chat_tail)(
                        error_body(503, MESSAGE, code=SHUTTING_DOWN))
                await send({"type": "http.response.body", "body": tail})
        finally:
            self._running.discard(task)
            self._cut.discard(task)


def _chat_tail(error: dict[str, object]) -> bytes:
    """The end of a cut chat or completions stream (as openai_stream.py ends a failed one)."""
    return sse_event(error) + SSE_DONE
