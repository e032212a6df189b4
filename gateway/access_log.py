"""One INFO line per HTTP request on the ``loragate.access`` logger.

    POST /v1/completions 200 tenant=acme adapter=a0 prompt_tokens=12 completion_tokens=8
    ttft_ms=35.1 duration_ms=120.4 request_id=gw-6f1c... user=u-123

AccessLog is a pure ASGI middleware (no per-chunk cost on streams) that times the request
from its arrival to the last byte of its response, and hands every response's status to
``observe`` (the response metrics: it sees refusals made before any route ran). A response
its client left before the last byte (a stream abandoned mid-way) is status 0 there, and
499 in the line, as nginx logs a closed client, not the 200 it started with. Routes
that know more (the tenant, the adapter, token counts, when the first token came) fill the
AccessRecord they find with ``record_of(request)``; fields nobody filled are logged as
``-``. The line holds no key, prompt or body: it is safe to keep.

Every response carries an ``x-request-id`` (a route's own, the first request it sent an
engine, or else one made here: refusals and errors too, as OpenAI sends one with each), and
the line names it, so a client can quote any answer it got and the operator find it: an
internal error's 500 too, which is answered here (the traceback logged, the caller told
nothing of it) rather than by the server's outermost middleware, which would send it
without one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.http.errors import error_body
from gateway.job import new_request_id

log = logging.getLogger("loragate.access")
errors = logging.getLogger(__name__)
SCOPE_KEY = "loragate.access"
REQUEST_ID = b"x-request-id"


@dataclass
class AccessRecord:
    """What one request's access line says beyond method, path, status and duration."""

    start: float
    tenant: str | None = None
    adapter: str | None = None
    end_user: str | None = None
    """The request's own end-user id (OpenAI's ``user``): what it is for, telling abuse
    apart per end user, needs it in the log."""
    safety_identifier: str | None = None
    """OpenAI's newer name for it (both are logged when a request sends both)."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    """time.monotonic() of the first generated token."""
    request_id: str | None = None
    """The response's x-request-id."""
    finish: Callable[[AccessRecord], None] | None = None
    """Called once the response is sent, before the line is logged (a route fills in what
    it learned while streaming: token counts, the first token's time)."""


def record_of(request: Request) -> AccessRecord | None:
    """The request's record (None when the app runs without AccessLog, e.g. in a test)."""
    record = request.scope.get(SCOPE_KEY)
    return record if isinstance(record, AccessRecord) else None


class AccessLog:
    """See the module docstring."""

    def __init__(self, app: ASGIApp,
                 observe: Callable[[Scope, int], None] | None = None) -> None:
        self.app = app
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord(time.monotonic())
        scope[SCOPE_KEY] = record
        status = 0  # 0: no response started (the client went away first)
        complete = False

        async def send_status(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message = _with_request_id(message, record)
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            if status:  # a response started: all that is left is to cut it, outside
                complete = True
                raise
            errors.exception("unhandled error")
            await JSONResponse(error_body(500, "internal error"), status_code=500)(
                scope, receive, send_status)
        finally:
            if not complete:  # a response left unfinished: its client went away (a stream
                status = 0    # abandoned mid-way), not the status it started with
            if self.observe is not None:
                self.observe(scope, status)
            if log.isEnabledFor(logging.INFO):
                if record.finish is not None:
                    record.finish(record)
                log.info("%s", access_line(scope["method"], scope["path"], status or 499, record,
                                           time.monotonic()))


def _with_request_id(start: Message, record: AccessRecord) -> Message:
    """The response start with an x-request-id (its own, or a new one), noted in
    ``record``."""
    headers = list(start.get("headers", ()))
    given = next((value for name, value in headers if name.lower() == REQUEST_ID), None)
    if given is not None:
        record.request_id = given.decode("latin-1")
        return start
    record.request_id = new_request_id()
    return {**start, "headers": [*headers, (REQUEST_ID, record.request_id.encode())]}


def access_line(method: str, path: str, status: int, record: AccessRecord, now: float) -> str:
    """The logged line (see the module docstring)."""
    def show(value: object) -> str:
        return "-" if value is None else str(value)

    ttft = (f"{(record.first_token_at - record.start) * 1000:.1f}"
            if record.first_token_at is not None else "-")
    return (f"{method} {_printable(path)} {status} tenant={show(record.tenant)} "
            f"adapter={show(record.adapter)} prompt_tokens={show(record.prompt_tokens)} "
            f"completion_tokens={show(record.completion_tokens)} ttft_ms={ttft} "
            f"duration_ms={(now - record.start) * 1000:.1f}" + (
                f" request_id={_printable(record.request_id)}" if record.request_id else "")
            + (f" user={_printable(record.end_user)}" if record.end_user else "")
            + (f" safety_identifier={_printable(record.safety_identifier)}"
               if record.safety_identifier else ""))


def _printable(text: str) -> str:
    """The client's text as printable ASCII without spaces, bounded: no line can be forged."""
    text = text[:200].encode("ascii", "backslashreplace").decode()
    return "".join(c if c.isprintable() and c != " " else f"\\x{ord(c):02x}" for c in text)
