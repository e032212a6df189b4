"""HTTP client of one engine server (see engine/server.py for the API).

Failures are sorted by what the gateway may do next:
- EngineUnavailable: the engine could not take the request (connection refused or reset
  before a response, 5xx, draining). Nothing was generated, so another instance may serve it.
- EngineRejected: the engine refused the request itself (4xx): the client's fault, the same
  answer anywhere, so it is passed on and never retried.
- EngineStreamBroken: the stream died after it started; tokens may have reached the client.

A 401 is never the client's fault: the gateway's engine token is wrong (or missing), so it
is EngineUnavailable too, and logged once per client (the tenant sees 503, not 401).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger(__name__)
ACCEPTED: dict[str, Any] = {"accepted": True}
"""Yielded once by EngineClient.generate() when the engine took the request (HTTP 200),
before any token: failures up to here leave nothing sent anywhere."""


class EngineUnavailable(Exception):
    """The request never started on this engine; safe to retry elsewhere."""


class EngineStreamBroken(Exception):
    """The engine's stream ended without a final chunk."""


class EngineRejected(Exception):
    """The engine answered 4xx; ``status`` and ``body`` (OpenAI error schema) say why."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else str(body)
        super().__init__(message)
        self.status = status
        self.body = body
        self.message = str(message)


@dataclass(frozen=True)
class ClientTimeouts:
    """connect: to open a connection; control: state / abort / adapter calls; a generate
    stream has no read timeout of its own (the gateway's request timeout bounds it)."""

    connect: float = 2.0
    control: float = 10.0


class EngineClient:
    """Talks to one engine server at base_url over a shared aiohttp.ClientSession (aiohttp
    rather than httpx on this hot path: its C HTTP parser costs a fraction per request and
    per streamed line). With a token (the engines' --engine-token), every call carries
    ``Authorization: Bearer <token>``."""

    def __init__(self, base_url: str, http: aiohttp.ClientSession,
                 timeouts: ClientTimeouts | None = None, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._token_refused_logged = False
        self._timeouts = timeouts or ClientTimeouts()
        self._control = aiohttp.ClientTimeout(total=self._timeouts.control,
                                              connect=self._timeouts.connect)
        self._stream = aiohttp.ClientTimeout(total=None, connect=self._timeouts.connect)

    async def generate(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Yield ACCEPTED, then the engine's stream chunks. Closing the generator early
        closes the connection, which makes the engine abort the request."""
        try:
            response = await self._http.post(self.base_url + "/generate",
                                             json={**body, "stream": True},
                                             timeout=self._stream, headers=self._headers)
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
        finished = False
        try:
            if response.status >= 400:
                body_json = await _json_or_text(response)
                if response.status >= 500 or response.status == 401:
                    self._token_refused(response.status)
                    raise EngineUnavailable(f"{self.base_url}: HTTP {response.status}")
                raise EngineRejected(response.status, body_json)
            yield ACCEPTED
            try:
                async for line in response.content:
                    if not line.strip():
                        continue
                    chunk = json.loads(line)
                    finished = bool(chunk.get("finished"))
                    yield chunk
                    if finished:
                        return
            except (aiohttp.ClientError, OSError) as exc:
                raise EngineStreamBroken(f"{self.base_url}: stream broke: {exc}") from exc
            raise EngineStreamBroken(f"{self.base_url}: stream ended before the request "
                                     f"finished")
        finally:
            if finished:
                response.release()  # whole response read: the connection is reusable
            else:
                response.close()  # cut it: the engine sees the disconnect and aborts

    async def abort(self, request_id: str) -> None:
        """Best effort: the engine may be gone, or the request already finished."""
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with self._http.post(self.base_url + "/abort",
                                       json={"request_id": request_id},
                                       timeout=self._control,
                                       headers=self._headers) as response:
                await response.read()

    async def state(self, cursor: int = 0) -> dict[str, Any]:
        result: dict[str, Any] = await self._send("GET", "/state", params={"cursor": cursor},
                                                  rejected_is_unavailable=True)
        return result

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        return await self._send("POST", "/adapters", {"name": name, "path": path})

    async def unload_adapter(self, name: str) -> dict[str, Any]:
        return await self._send("DELETE", f"/adapters/{name}")

    async def pin_adapter(self, name: str, pinned: bool) -> dict[str, Any]:
        return await self._send("POST", f"/adapters/{name}/pin", {"pinned": pinned})

    async def _send(self, method: str, path: str, body: dict[str, Any] | None = None,
                    params: dict[str, Any] | None = None,
                    rejected_is_unavailable: bool = False) -> Any:
        try:
            async with self._http.request(method, self.base_url + path, json=body,
                                          params=params, timeout=self._control,
                                          headers=self._headers) as response:
                payload = await _json_or_text(response)
                status = response.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise EngineUnavailable(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
        self._token_refused(status)
        if status >= 500 or status == 401 or (status >= 400 and rejected_is_unavailable):
            raise EngineUnavailable(f"{self.base_url}{path}: HTTP {status}")
        if status >= 400:
            raise EngineRejected(status, payload)
        return payload

    def _token_refused(self, status: int) -> None:
        if status == 401 and not self._token_refused_logged:
            self._token_refused_logged = True  # once: the poller would repeat it every beat
            log.error("engine %s refused this gateway's engine token (HTTP 401): give the "
                      "gateway the engines' token (--engine-token)", self.base_url)


async def _json_or_text(response: aiohttp.ClientResponse) -> dict[str, Any]:
    text = await response.text()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    if isinstance(body, list):
        return {"items": body}
    return {"error": {"message": text[:500], "type": "server_error"}}
