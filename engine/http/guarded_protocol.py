"""uvicorn's HTTP protocol plus the limits it lacks: a deadline and a size cap for request
headers, a deadline for a client that stops reading its response, and a bounded close for
a client whose upload an early answer cut short. The gateway and the engine servers use it.

uvicorn (httptools) times out idle keep-alive connections between requests, but not a
connection that never sends anything or trickles a request's headers, and httptools buffers
a header line of any length. So one client could hold a socket forever, or grow the
server's memory without bound, before any route (or key check) runs. This protocol:

- arms a timer when a connection opens, and again at the first byte of each later request;
  the request line and headers must be complete before it fires, else 408 and close;
- counts the bytes of a request's line and headers, both as they arrive (a header block that
  never ends; of the read it began in, what follows the previous request's body) and as
  the parser reads them (a block that came in one read): past max_header_bytes, 431 and
  close;
- arms a timer whenever the transport's write buffer is full (asyncio pauses writing: the
  client reads nothing), disarmed when it drains: past write_timeout_s the connection is
  dropped. Without it a client that stops reading a stream holds its request, and the
  output buffered for it, for as long as it keeps the socket open; dropped, the request
  sees a disconnect and ends (its engine work is aborted);
- closes a connection answered while its request body still arrives (an early 413 or 401
  with ``connection: close``, gateway/guard.py), by lingering: the answer is sent and the
  write side shut (FIN), and what the client still sends is read and dropped until it
  closes, for at most LINGER_S and LINGER_MAX_BYTES. A socket closed with unread bytes in
  its buffer sends a reset, which can destroy the answer before the client reads it (the
  openai SDK then retries the whole upload).
- bounds a request answered while its body still arrives when the answer keeps the
  connection (an early 401 or 404, or a route that reads no body): uvicorn drops that body
  as it comes, but each byte stops its keep-alive deadline and nothing starts it again,
  so such a connection stayed open for good. The body must end within LINGER_S and
  LINGER_MAX_BYTES, else the connection closes; once it ends, the keep-alive deadline runs
  again and the connection serves the client's next request.

A client's FIN is taken as a hang-up, as uvicorn and nginx take it: the connection closes
and its request's engine work is aborted. A FIN cannot tell a client gone from one that
only shut its write side (`nc -N`), and keeping the request for the second would let every
client that hangs up mid-request hold its generation to the end, unseen until the answer
is written; a half-closing client gets no answer.

These answers, and the 400 for a request that is not valid HTTP, carry an OpenAI-style error
body. A request whose own body is malformed (a bad chunk) is answered 400 unless its
response has started; a malformed request pipelined after complete ones gets its 400 once
they are answered. Request bodies are bounded where the route is known, in gateway/guard.py
(size limit and read deadline).
"""

from __future__ import annotations

import asyncio
import json
import logging
from asyncio import TimerHandle
from collections.abc import Callable
from typing import Any, cast

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from engine.http.errors import REFUSED_FRAMING_KEY, error_body

log = logging.getLogger(__name__)


class _HeadersTooLarge(Exception):
    """Raised from a parser callback: httptools stops parsing, and uvicorn answers the
    parser error (send_400_response, which answers 431 instead)."""


LINGER_S = 5.0
"""How long a closing connection keeps reading (and dropping) a request body still arriving."""
LINGER_MAX_BYTES = 64 << 20
"""How much of it it reads before closing regardless."""


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: close() lingers (see the module
    docstring) while the current request's body is still arriving; the rest is the real
    transport's."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedHttpProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def close(self) -> None:
        cycle = self._protocol.cycle
        if (not self._protocol.lingering and not self._transport.is_closing()
                and cycle is not None and cycle.more_body):
            self._protocol.linger()
        else:
            self._transport.close()


class GuardedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a header deadline, a header size cap and a write-stall deadline
    (class attributes: ``guarded_protocol`` makes a subclass with the configured values)."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 65536
    write_timeout_s: float = 60.0
    count_refusal: Callable[[int, str], None] | None = None
    """Called with (status, code) for each answer sent before any app saw its request (a
    malformed request, headers too large or too late), for the server's response metrics."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_timer: TimerHandle | None = None
        self._awaiting_headers = True
        """Between a connection's opening (or a request's first byte) and the end of that
        request's headers."""
        self._header_bytes = 0
        self._parsed_header_bytes = 0
        self._request_began_in_read = False
        """A request began in the read being parsed: the bytes before it in that read are
        not its own (a body, earlier pipelined requests)."""
        self._read_elsewhere = 0
        """Bytes of the read being parsed known to be another request's: its body, and its
        line and headers as parsed (less than their bytes on the wire: the request's own
        count is then over, never under, by the previous request's framing)."""
        self._headers_too_large = False
        self._write_timer: TimerHandle | None = None
        self._deferred_reject: tuple[int, str, str] | None = None
        """A refusal that waits for the pipelined requests before it to be answered."""
        self.lingering = False
        """Answered and half-closed: what arrives now is dropped until the client closes."""
        self._lingered_bytes = 0
        self._linger_timer: TimerHandle | None = None
        self._real_transport: asyncio.Transport | None = None
        self._answered_body_timer: TimerHandle | None = None
        """Runs while the body of a request answered before it arrived is read and dropped."""
        self._answered_body_bytes = 0
        self._answered_body_ended = False
        """Set by the parser when that body ends; data_received then restarts keep-alive."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._real_transport = transport
        super().connection_made(cast(asyncio.Transport, _LingeringTransport(transport, self)))
        self._arm_header_timer()  # the first request's deadline runs from the connect

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_write_timer()
        self._cancel_answered_body_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def linger(self) -> None:
        """Shut the write side once the answer is out, and drop what still arrives until
        the client closes (its FIN closes the transport), LINGER_S pass or LINGER_MAX_BYTES
        arrive."""
        transport = self._real_transport
        assert transport is not None
        self.lingering = True
        self._cancel_header_timer()
        self.flow.resume_reading()  # a body over uvicorn's high-water mark paused reading
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:  # the peer is gone already (ENOTCONN): nothing to linger for
                transport.close()
                return
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stalled(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing():
            peer = "{}:{}".format(*self.client) if self.client else "a client"
            log.warning("dropping the connection of %s: it read nothing of its response for "
                        "%g s", peer, self.write_timeout_s)
            self.transport.abort()  # unsent output is dropped; the request sees a disconnect

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self._lingered_bytes += len(data)
            if self._lingered_bytes > LINGER_MAX_BYTES and self._real_transport is not None:
                self._real_transport.close()
            return
        if self._deferred_reject is not None:
            return  # the parser stopped at an error: nothing after it is a request
        if self._answered_body_timer is not None:
            self._answered_body_bytes += len(data)
            if self._answered_body_bytes > LINGER_MAX_BYTES:
                self._close_answered_connection()
                return
        self._request_began_in_read = False
        self._read_elsewhere = 0
        super().data_received(data)
        if self._answered_body_ended:
            self._answered_body_ended = False
            self._restart_keep_alive()
        if not self._awaiting_headers or self.transport.is_closing():
            return
        # Its headers are still incomplete: all of this read is theirs, but for what came
        # before the request in the read it began in.
        self._header_bytes += len(data) - (self._read_elsewhere
                                           if self._request_began_in_read else 0)
        if self._header_bytes > self.max_header_bytes:
            self._reject_large_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_headers = True
        self._request_began_in_read = True
        self._header_bytes = self._parsed_header_bytes = 0
        if self._header_timer is None:
            self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        self._count_parsed(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_parsed(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_parsed(self, size: int) -> None:
        self._parsed_header_bytes += size
        if self._parsed_header_bytes > self.max_header_bytes:
            self._headers_too_large = True
            raise _HeadersTooLarge

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parser error (plain text there): JSON, and 431 when the
        parser stopped at the header cap."""
        if self._headers_too_large:
            self._reject_large_headers()
        else:
            self._reject(400, msg, "invalid_http_request")

    def _reject_large_headers(self) -> None:
        self._reject(431, f"request headers over {self.max_header_bytes} bytes",
                     "headers_too_large")

    def on_body(self, body: bytes) -> None:
        self._read_elsewhere += len(body)
        super().on_body(body)

    def on_headers_complete(self) -> None:
        self._read_elsewhere += self._parsed_header_bytes
        self._awaiting_headers = False
        self._cancel_header_timer()
        super().on_headers_complete()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._awaiting_headers and not self.transport.is_closing():
            self._reject(408, f"request headers not received within "
                              f"{self.header_timeout_s:g} s", "request_timeout")

    def on_response_complete(self) -> None:
        last = not self.pipeline  # else super() starts the next queued request
        # Only the last request parsed can have a body still arriving: with none queued (and
        # none refused from the queue) it is the one just answered.
        body_arriving = (last and self._deferred_reject is None and self.cycle is not None
                         and self.cycle.more_body)
        super().on_response_complete()
        if self._deferred_reject is not None and last and not self.transport.is_closing():
            self._reject(*self._deferred_reject)  # every request before it is answered
        elif body_arriving and not self.transport.is_closing():
            # Its bytes would stop the keep-alive deadline super() just started: the body's
            # own deadline holds instead, and its end starts keep-alive again.
            self._unset_keepalive_if_required()
            self._answered_body_bytes = 0
            self._answered_body_timer = self.loop.call_later(
                LINGER_S, self._close_answered_connection)

    def on_message_complete(self) -> None:
        if self._answered_body_timer is not None:  # the parser is mid-message, so it is
            self._cancel_answered_body_timer()      # that answered request's body that ended
            self._answered_body_ended = True
            self.cycle.more_body = False  # super() leaves an answered cycle's flag as it was
        super().on_message_complete()

    def _restart_keep_alive(self) -> None:
        """uvicorn's deadline between requests, unless the read that ended the answered
        body also began the next request (its header deadline runs instead)."""
        cycle = self.cycle
        if (self._awaiting_headers or cycle is None or not cycle.response_complete
                or self.pipeline or self.timeout_keep_alive_task is not None
                or self.transport.is_closing()):
            return
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _close_answered_connection(self) -> None:
        """The answered request's body is late or too large: close (the answer went out
        before it, so a reset from unread bytes can no longer destroy it)."""
        self._cancel_answered_body_timer()
        if self._real_transport is not None and not self._real_transport.is_closing():
            self._real_transport.close()

    def _cancel_answered_body_timer(self) -> None:
        if self._answered_body_timer is not None:
            self._answered_body_timer.cancel()
            self._answered_body_timer = None

    def _reject(self, status: int, message: str, code: str) -> None:
        """Answer and close. A request in progress on this connection decides when: one
        whose response has started is only closed (bytes now would corrupt it); one whose
        body the error cut is told the client is gone and the answer goes now, unless
        requests before it are still to be answered (pipelined): then it is dropped from
        their queue, and the answer goes after theirs, as for an error after whole ones.
        One answered before its body arrived (the error is in that body) is only closed:
        it had its answer."""
        self._cancel_header_timer()
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and cycle.more_body:
            self._close_answered_connection()
            return
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                self.transport.close()
                return
            queued = cycle.more_body and bool(self.pipeline)
            if queued:  # the last parsed request is the queue's newest: it never runs
                self.pipeline.popleft()
            if queued or not cycle.more_body:
                self._deferred_reject = (status, message, code)
                return
            # Its app reads a disconnect and answers nothing more; its access line and
            # metrics count this answer (engine/http/errors.py).
            cycle.scope[REFUSED_FRAMING_KEY] = (status, message, code)  # type: ignore[literal-required]
            cycle.disconnected = True
            cycle.message_event.set()
        elif self.count_refusal is not None:  # no app saw this request: counted here
            self.count_refusal(status, code)
        body = json.dumps(error_body(status, message, code=code),
                          separators=(",", ":")).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n",
                 b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def guarded_protocol(header_timeout_s: float, max_header_bytes: int,
                     write_timeout_s: float,
                     count_refusal: Callable[[int, str], None] | None = None
                     ) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn.Config(http=...) for these limits."""

    class Configured(GuardedHttpProtocol):
        pass

    Configured.header_timeout_s = header_timeout_s
    Configured.max_header_bytes = max_header_bytes
    Configured.write_timeout_s = write_timeout_s
    Configured.count_refusal = staticmethod(count_refusal) if count_refusal else None
    return Configured
