"""Guard: the pure ASGI middleware in front of every gateway route.

No BaseHTTPMiddleware: that one relays every streamed chunk through an extra task and memory
stream, a cost paid per token. In order, for each HTTP request:

- 400 for a request two proxies could read as two different ones: more than one Host
  header, or an encoded slash (%2F) in the path outside a model id (Starlette decodes it
  before routing, so "/admin%2Ftenants" would pass a proxy's "/admin/" rule and reach the
  admin API here); 501 for a Transfer-Encoding other than chunked (uvicorn reads any as
  chunked: a proxy that reads it otherwise sees another body, RFC 9112 6.1);
- 400 when the Host header is not allowed (the open mode's DNS-rebinding defence, see
  gateway/exposure.py);
- 413 for a Content-Length over the path's limit;
- 415 for a body with a Content-Encoding (gzip, ...): bodies are read as sent;
- 503 for new generation requests while the gateway drains;
- 401 (or the admin API's 401 / 403) before a body is read when the caller's key is unknown:
  an anonymous client must not make the gateway parse megabytes of JSON;
- while the app reads the body: 413 once it grows past the limit (chunked uploads), 408 when
  it has not all arrived by its deadline (body_timeout_s from the headers, plus a second per
  MiB received, so a big upload at a sane rate is never cut off but a trickle is);
- a response that starts before the body was read in full (an early error) closes the
  connection: uvicorn would otherwise keep reading, and discarding, what the client sends.

Every refusal is an OpenAI-style error body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.http.errors import ERROR_CODE_KEY, ApiError, CodedHTTPException
from gateway.exposure import host_allowed

REQUEST_TOO_LARGE = "request_too_large"
MODEL_PATH = b"/v1/models/"
"""GET /v1/models/{id}: an id may hold a slash (a served name such as "org/model"), which a
client may encode."""
BYTES_PER_EXTRA_SECOND = 1 << 20
"""Each MiB of body received moves the body's deadline one second later."""


class Guard:
    """See the module docstring. restrict_hosts() says whether the Host check applies now
    (the open mode can end while the gateway runs: the first tenant is created)."""

    def __init__(self, app: ASGIApp, max_bytes: Callable[[str], int],
                 draining: Callable[[], bool], retry_after_s: int, body_timeout_s: float,
                 restrict_hosts: Callable[[], bool], allowed_hosts: tuple[str, ...],
                 caller_refusal: Callable[[Scope], Awaitable[ApiError | None]]) -> None:
        self.app = app
        self.max_bytes_for = max_bytes
        self.draining = draining
        self.retry_after_s = retry_after_s
        self.body_timeout_s = body_timeout_s
        self.restrict_hosts = restrict_hosts
        self.allowed_hosts = allowed_hosts
        self.caller_refusal = caller_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        max_bytes = self.max_bytes_for(path)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        body_done = length in (None, b"0") and b"transfer-encoding" not in headers
        received = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_done:
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"connection", b"close")]}
            await send(message)

        async def limited_receive() -> Message:
            nonlocal received, body_done, deadline
            if body_done:  # what is left to receive is the disconnect: no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                # An HTTPException: FastAPI passes it on from body parsing, and the error
                # handlers render it in OpenAI's schema.
                raise CodedHTTPException(408, "the request body did not arrive in time",
                                         code="body_timeout") from None
            if message["type"] != "http.request":
                body_done = True
                return message
            chunk = len(message.get("body", b""))
            received += chunk
            deadline += chunk / BYTES_PER_EXTRA_SECOND
            body_done = not message.get("more_body", False)
            if received > max_bytes:
                raise CodedHTTPException(413, f"request body over {max_bytes} bytes",
                                         code=REQUEST_TOO_LARGE)
            return message

        refusal = self._refusal(scope, headers, length, max_bytes, body_done)
        if refusal is None and not body_done:
            refusal = await self.caller_refusal(scope)
        if refusal is not None:
            scope[ERROR_CODE_KEY] = refusal.code  # the response metrics' code label
            await refusal.response()(scope, receive, guarded_send)
            return
        await self.app(scope, limited_receive, guarded_send)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes], length: bytes | None,
                 max_bytes: int, no_body: bool) -> ApiError | None:
        """The answer to a request refused on its headers alone, or None."""
        if sum(name == b"host" for name, _ in scope["headers"]) > 1:
            return ApiError(400, "more than one Host header", code="invalid_host")
        raw_path = scope.get("raw_path") or b""
        if b"%2f" in raw_path.lower() and not raw_path.startswith(MODEL_PATH):
            return ApiError(400, "the path holds an encoded slash (%2F): write '/'",
                            code="invalid_path")
        coding = headers.get(b"transfer-encoding", b"chunked").strip().lower()
        if coding != b"chunked":
            return ApiError(501, f"Transfer-Encoding {coding[:32].decode('latin-1')!r} is "
                            f"not supported: send the body chunked or with a Content-Length",
                            code="unsupported_transfer_encoding")
        if self.restrict_hosts() and not host_allowed(
                headers.get(b"host", b"").decode("latin-1"), self.allowed_hosts):
            return ApiError(400, "the Host header names a host this gateway does not serve "
                            "(it answers loopback names and --allowed-hosts only)",
                            code="host_not_allowed")
        if length is not None and (not length.isdigit() or int(length) > max_bytes):
            return ApiError(413, f"request body over {max_bytes} bytes",
                            code=REQUEST_TOO_LARGE)
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if not no_body and encoding not in (b"", b"identity"):  # read as is: garbage
            return ApiError(415, f"Content-Encoding {encoding[:32].decode('latin-1')!r} is "
                            f"not supported: send the body uncompressed",
                            code="unsupported_encoding")
        if self.draining() and scope["path"].startswith("/v1/") and scope["method"] == "POST":
            return ApiError(503, "the gateway is shutting down", code="draining",
                            headers={"Retry-After": str(self.retry_after_s)})
        return None
