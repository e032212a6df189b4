"""HTTP client of one engine server (engine/http/server.py): an EngineClient
(engine/protocol.py) whose requests and chunks travel as JSON.

Failures are sorted by what the gateway may do next (the protocol's errors):
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
from aiohttp.http_exceptions import HttpProcessingError

from engine.protocol import (
    ChunkStream,
    EngineRejected,
    EngineState,
    EngineStreamBroken,
    EngineUnavailable,
    GenerateRequest,
    LoadedAdapter,
    StreamChunk,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientTimeouts:
    """connect: to open a connection; control: abort / adapter calls; state: the state poll;
    a generate stream has no read timeout of its own (the gateway's request timeout bounds
    it)."""

    connect: float = 2.0
    control: float = 10.0
    state: float = 3.0
    """Shorter than control: a state call that times out is followed by a /health probe that
    tells a busy engine (a step longer than this) from a frozen one, so a short wait costs a
    busy engine nothing and finds a frozen one seconds sooner."""


class HttpEngineClient:
    """Talks to one engine server at base_url over a shared aiohttp.ClientSession (aiohttp
    rather than httpx on this hot path: its C HTTP parser costs a fraction per request and
    per streamed line). With a token (the engines' --engine-token), every call carries
    ``Authorization: Bearer <token>``."""

    def __init__(self, base_url: str, http: aiohttp.ClientSession,
                 timeouts: ClientTimeouts | None = None, token: str | None = None,
                 control: aiohttp.ClientSession | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._control_http = control or http
        """State, abort and adapter calls: a session of their own (the gateway's), so that
        a pool full of streams never holds them back (a poll that waited for a connection
        would look like an engine that stopped answering)."""
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._token_refused_logged = False
        self._timeouts = timeouts or ClientTimeouts()
        self._control = aiohttp.ClientTimeout(total=self._timeouts.control,
                                              connect=self._timeouts.connect)
        self._state = aiohttp.ClientTimeout(total=self._timeouts.state,
                                            connect=self._timeouts.connect)
        self._stream = aiohttp.ClientTimeout(total=None, connect=self._timeouts.connect)

    async def open(self, request: GenerateRequest) -> ChunkStream:
        """POST /generate; returns once the engine answered 200. Closing the stream early
        closes the connection, which makes the engine abort the request."""
        try:
            response = await self._http.post(self.base_url + "/generate",
                                             json={**request.to_json(), "stream": True},
                                             timeout=self._stream, headers=self._headers)
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
        if response.status >= 400:
            try:
                self._raise_for(response.status, await _json_or_text(response), "/generate")
            finally:
                response.release()
        return ChunkStream(self._chunks(response), response.close)

    async def _chunks(self, response: aiohttp.ClientResponse
                      ) -> AsyncGenerator[StreamChunk, None]:
        finished = False
        try:
            try:
                async for line in _lines(response.content):
                    if not line.strip():
                        continue
                    chunk = StreamChunk.from_json(json.loads(line))
                    finished = chunk.finished
                    yield chunk
                    if finished:
                        return
            except (aiohttp.ClientError, HttpProcessingError, OSError) as exc:
                raise EngineStreamBroken(f"{self.base_url}: stream broke: {exc}") from exc
            except (ValueError, KeyError, TypeError) as exc:
                raise EngineStreamBroken(f"{self.base_url}: not a stream chunk: {exc}") from exc
            raise EngineStreamBroken(f"{self.base_url}: stream ended before the request "
                                     f"finished")
        finally:
            if finished:
                response.release()  # whole response read: the connection is reusable
            else:
                response.close()  # cut it: the engine sees the disconnect and aborts

    async def abort(self, request_id: str) -> bool:
        """Best effort: False when the engine is gone or did not know the request."""
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with self._control_http.post(self.base_url + "/abort",
                                       json={"request_id": request_id},
                                       timeout=self._control,
                                       headers=self._headers) as response:
                body = await _json_or_text(response)
                return bool(body.get("aborted"))
        return False

    async def alive(self) -> bool:
        """GET /health, answered by the engine server's event loop whatever the engine
        thread is doing: 200 within the connect timeout (the step may take longer)."""
        try:
            async with self._control_http.get(
                    self.base_url + "/health", headers=self._headers,
                    timeout=aiohttp.ClientTimeout(total=2 * self._timeouts.connect)
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def state(self, cursor: int = 0) -> EngineState:
        payload = await self._send("GET", "/state", params={"cursor": cursor},
                                   rejected_is_unavailable=True, timeout=self._state)
        try:
            return EngineState.from_json(payload)
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise EngineUnavailable(f"{self.base_url}/state: malformed answer: {exc!r}"
                                    ) from None

    async def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        return LoadedAdapter.from_json(
            await self._send("POST", "/adapters", {"name": name, "path": path}))

    async def unload_adapter(self, name: str, digest: str | None = None) -> None:
        await self._send("DELETE", f"/adapters/{name}",
                         params=None if digest is None else {"digest": digest})

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        await self._send("POST", f"/adapters/{name}/pin", {"pinned": pinned})

    async def _send(self, method: str, path: str, body: dict[str, Any] | None = None,
                    params: dict[str, Any] | None = None,
                    rejected_is_unavailable: bool = False,
                    timeout: aiohttp.ClientTimeout | None = None) -> dict[str, Any]:
        try:
            async with self._control_http.request(method, self.base_url + path, json=body,
                                          params=params, timeout=timeout or self._control,
                                          headers=self._headers) as response:
                payload = await _json_or_text(response)
                status = response.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise EngineUnavailable(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
        if status >= 400 and rejected_is_unavailable:
            self._token_refused(status)
            raise EngineUnavailable(f"{self.base_url}{path}: HTTP {status}")
        self._raise_for(status, payload, path)
        return payload

    def _raise_for(self, status: int, payload: dict[str, Any], path: str) -> None:
        """EngineUnavailable for 5xx and 401, EngineRejected for other 4xx."""
        if status < 400:
            return
        self._token_refused(status)
        if status >= 500 or status == 401:
            raise EngineUnavailable(f"{self.base_url}{path}: HTTP {status}")
        error = payload.get("error")
        raise EngineRejected.from_json(error if isinstance(error, dict) else {}, status)

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


MAX_LINE_BYTES = 1 << 30
"""The longest stream line taken from an engine (a line past it breaks the stream): far
above any chunk (a 128k-token prompt's prompt_logprobs at k=20 is about 100 MB)."""


async def _lines(content: aiohttp.StreamReader) -> AsyncGenerator[bytes, None]:
    """The body's lines, however long: aiohttp's own line reader refuses lines over 512 KiB,
    and one chunk (a long prompt's prompt_logprobs) can be megabytes."""
    pending = bytearray()
    searched = 0  # bytes of pending known to hold no newline: each byte is scanned once
    async for data in content.iter_any():
        pending += data
        while (end := pending.find(b"\n", searched)) >= 0:
            yield bytes(pending[:end])
            del pending[:end + 1]
            searched = 0
        searched = len(pending)
        if searched > MAX_LINE_BYTES:
            raise ValueError(f"a stream line over {MAX_LINE_BYTES} bytes")
    if pending:
        yield bytes(pending)
