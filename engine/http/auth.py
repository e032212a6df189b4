"""The engine API's shared token: who may call an engine at all.

An engine trusts its callers completely (they send any tenant's prompts, load adapters,
abort requests), so every route but ``GET /health`` needs ``Authorization: Bearer TOKEN``
once a token is configured, and an engine refuses to listen beyond loopback without one.
Gateways hold the same token (``--engine-token``); ``loragate serve`` makes one up per run
for the engines it starts itself.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.http.errors import ApiError

OPEN_ROUTES = frozenset({("GET", "/health"), ("HEAD", "/health")})
"""(method, path) pairs served without the token: load balancers and `serve` probe these."""
TOKEN_ENV = "LORAGATE_ENGINE_TOKEN"


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1); False for every name or
    address other hosts may reach, 0.0.0.0 and :: included."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None) -> None:
    """ValueError when the engine would listen beyond loopback without a token."""
    if token is None and not is_loopback(host):
        raise ValueError(f"refusing to serve the engine API on {host} without a token: set "
                         f"--engine-token-file FILE, --engine-token or {TOKEN_ENV} (the "
                         f"gateways need the same token)")


def check_token(token: str | None) -> str | None:
    """The token as given; ValueError for an empty or whitespace-padded one (a typo that
    would otherwise lock every gateway out, or let a shell quirk decide the secret)."""
    if token is not None and (not token or token != token.strip()):
        raise ValueError("the engine token must be non-empty, without leading or trailing "
                         "whitespace")
    return token


def read_token_file(path: str) -> str:
    """The token in a file, surrounding whitespace (a trailing newline) stripped."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the engine token file {path!r}: {exc}") from None
    if not token:
        raise ValueError(f"the engine token file {path!r} is empty")
    return token


def _digest(header: bytes) -> bytes:
    # Compared as digests: equal lengths, so the comparison's time says nothing about the
    # token's length either.
    return hashlib.sha256(header).digest()


class TokenAuth:
    """Pure ASGI middleware: 401 (OpenAI error schema) for any request but OPEN_ROUTES
    without ``Authorization: Bearer <token>``. The comparison is constant-time
    (hmac.compare_digest) and the answer is the same for a missing and a wrong token."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        if not token:
            raise ValueError("TokenAuth needs a non-empty token")
        self.app = app
        self._expected = _digest(f"Bearer {token}".encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or (
                scope["type"] == "http" and (scope["method"], scope["path"]) in OPEN_ROUTES):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(_digest(given), self._expected):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":  # the API has none; refuse before the app anyway
            await send({"type": "websocket.close", "code": 1008})
        else:
            response = ApiError(401, "missing or invalid engine token", code="invalid_token",
                                headers={"WWW-Authenticate": "Bearer"}).response()
            await response(scope, receive, send)
