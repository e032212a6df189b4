"""HTTP client of one engine server (see engine/server.py for the API).

Failures are sorted by what the gateway may do next:
- EngineUnavailable: the engine could not take the request (connection refused or reset
  before a response, 5xx, draining). Nothing was generated, so another instance may serve it.
- EngineRejected: the engine refused the request itself (4xx): the client's fault, the same
  answer anywhere, so it is passed on and never retried.
- EngineStreamBroken: the stream died after it started; tokens may have reached the client.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import httpx

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
    """Talks to one engine server at base_url over a shared httpx.AsyncClient."""

    def __init__(self, base_url: str, http: httpx.AsyncClient,
                 timeouts: ClientTimeouts | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._timeouts = timeouts or ClientTimeouts()

    def _control_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self._timeouts.control, connect=self._timeouts.connect)

    async def generate(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Yield ACCEPTED, then the engine's stream chunks. Closing the generator early
        closes the connection, which makes the engine abort the request."""
        timeout = httpx.Timeout(None, connect=self._timeouts.connect)
        request = self._http.build_request("POST", self.base_url + "/generate",
                                           json={**body, "stream": True}, timeout=timeout)
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
        try:
            if response.status_code >= 400:
                await response.aread()
                if response.status_code >= 500:
                    raise EngineUnavailable(f"{self.base_url}: HTTP {response.status_code}")
                raise EngineRejected(response.status_code, _json_or_text(response))
            yield ACCEPTED
            finished = False
            try:
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    chunk = json.loads(line)
                    finished = bool(chunk.get("finished"))
                    yield chunk
                    if finished:
                        return
            except httpx.TransportError as exc:
                raise EngineStreamBroken(f"{self.base_url}: stream broke: {exc}") from exc
            if not finished:
                raise EngineStreamBroken(f"{self.base_url}: stream ended before the request "
                                         f"finished")
        finally:
            await response.aclose()

    async def abort(self, request_id: str) -> None:
        """Best effort: the engine may be gone, or the request already finished."""
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post(self.base_url + "/abort", json={"request_id": request_id},
                                  timeout=self._control_timeout())

    async def state(self, cursor: int = 0) -> dict[str, Any]:
        return await self._get_json("/state", params={"cursor": cursor})

    async def health(self) -> bool:
        try:
            response = await self._http.get(self.base_url + "/health",
                                            timeout=self._control_timeout())
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        return await self._send("POST", "/adapters", {"name": name, "path": path})

    async def unload_adapter(self, name: str) -> dict[str, Any]:
        return await self._send("DELETE", f"/adapters/{name}")

    async def pin_adapter(self, name: str, pinned: bool) -> dict[str, Any]:
        return await self._send("POST", f"/adapters/{name}/pin", {"pinned": pinned})

    async def metrics_text(self) -> str:
        response = await self._http.get(self.base_url + "/metrics",
                                        timeout=self._control_timeout())
        response.raise_for_status()
        return response.text

    async def _get_json(self, path: str, params: dict[str, Any] | None = None) -> Any:
        try:
            response = await self._http.get(self.base_url + path, params=params,
                                            timeout=self._control_timeout())
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise EngineUnavailable(f"{self.base_url}{path}: HTTP {response.status_code}")
        return response.json()

    async def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = await self._http.request(method, self.base_url + path, json=body,
                                                timeout=self._control_timeout())
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise EngineUnavailable(f"{self.base_url}{path}: HTTP {response.status_code}")
        if response.status_code >= 400:
            raise EngineRejected(response.status_code, _json_or_text(response))
        return response.json()


def _json_or_text(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    return {"error": {"message": response.text[:500], "type": "server_error"}}
