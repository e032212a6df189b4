"""uvicorn's HTTP protocol plus the two limits it lacks: a deadline and a size cap for request
headers.

uvicorn (httptools) times out idle keep-alive connections between requests, but not a
connection that never sends anything or trickles a request's headers, and httptools buffers
a header line of any length. So one client could hold a socket forever, or grow the
gateway's memory without bound, before any route (or key check) runs. This protocol:

- arms a timer when a connection opens, and again at the first byte of each later request;
  the request line and headers must be complete before it fires, else 408 and close;
- counts the bytes of a request's line and headers, both as they arrive (a header block that
  never ends) and as the parser reads them (a block that came in one read): past
  max_header_bytes, 431 and close.

These answers, and the 400 for a request that is not valid HTTP, carry an OpenAI-style error
body. Request bodies are bounded where the route is
known, in gateway/guard.py (size limit and read deadline).
"""

from __future__ import annotations

import asyncio
import json
from asyncio import TimerHandle
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from engine.http.errors import error_body


class _HeadersTooLarge(Exception):
    """Raised from a parser callback: httptools stops parsing, and uvicorn answers the
    parser error (send_400_response, which answers 431 instead)."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a header deadline and a header size cap (class attributes:
    ``guarded_protocol`` makes a subclass with the configured values)."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 65536

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_timer: TimerHandle | None = None
        self._awaiting_headers = True
        """Between a connection's opening (or a request's first byte) and the end of that
        request's headers."""
        self._header_bytes = 0
        self._parsed_header_bytes = 0
        self._headers_too_large = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()  # the first request's deadline runs from the connect

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._awaiting_headers or self.transport.is_closing():
            return
        # The whole chunk counts (a pipelined request's first bytes may share it with the
        # previous body: an overcount of at most one read, on a rare path).
        self._header_bytes += len(data)
        if self._header_bytes > self.max_header_bytes:
            self._reject_large_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_headers = True
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

    def on_headers_complete(self) -> None:
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

    def _reject(self, status: int, message: str, code: str) -> None:
        """Answer (unless an earlier response on this connection is still being written:
        bytes now would corrupt it) and close."""
        self._cancel_header_timer()
        if self.cycle is None or self.cycle.response_complete:
            body = json.dumps(error_body(status, message, code=code),
                              separators=(",", ":")).encode()
            head = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head += [b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
        self.transport.close()


def guarded_protocol(header_timeout_s: float, max_header_bytes: int) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn.Config(http=...) for these limits."""

    class Configured(GuardedHttpProtocol):
        pass

    Configured.header_timeout_s = header_timeout_s
    Configured.max_header_bytes = max_header_bytes
    return Configured
