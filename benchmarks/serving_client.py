"""One streamed request against a serving endpoint, timed chunk by chunk.

Two protocols:

- ``openai``: POST {base}/v1/completions with ``stream`` and ``stream_options.include_usage``;
  the answer is server-sent events, ``data: {json}`` lines ending with ``data: [DONE]``.
  A chunk with choices carries tokens unless it only closes the stream (empty text plus a
  finish_reason); the output token count is ``usage.completion_tokens`` when a chunk has it,
  else the number of token-carrying chunks.
- ``engine``: POST {base}/generate, the engine server's own API; the answer is NDJSON, one
  object per line, ``delta_token_ids`` carry the tokens, ``finished`` ends the stream and a
  non-null ``error`` fails the request.

A request never raises: every outcome, including transport errors, becomes a RequestRecord.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Literal

import httpx

from benchmarks.serving_metrics import RequestRecord

Protocol = Literal["openai", "engine"]
PROTOCOLS: tuple[Protocol, ...] = ("openai", "engine")
_MAX_ERROR_CHARS = 300


class StreamError(Exception):
    """The server answered 200 but the stream reported an error or ended early."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}"[:_MAX_ERROR_CHARS])


@dataclass(frozen=True)
class ServingRequest:
    """One request to send: prompt token ids, the exact output length, optional adapter."""

    prompt_token_ids: tuple[int, ...]
    output_len: int
    lora: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class _Timer:
    """Running timing state of one stream: token chunk times relative to the send."""

    start: float = field(default_factory=time.perf_counter)
    chunk_times: list[float] = field(default_factory=list)

    def token_chunk(self) -> None:
        self.chunk_times.append(time.perf_counter() - self.start)

    def record(self, request: ServingRequest, output_tokens: int, start_s: float
               ) -> RequestRecord:
        e2e = time.perf_counter() - self.start
        if not self.chunk_times:
            return RequestRecord(False, request.prompt_len, e2e_s=e2e, start_s=start_s,
                                 status_code=200, error="NoTokens: stream carried no tokens")
        t = self.chunk_times
        return RequestRecord(True, request.prompt_len, output_tokens, ttft_s=t[0],
                             itl_s=tuple(b - a for a, b in pairwise(t)),
                             e2e_s=e2e, start_s=start_s, status_code=200)


def openai_payload(request: ServingRequest, model: str) -> dict[str, Any]:
    """Body of a streamed /v1/completions request; the model is the adapter, if any."""
    return {"model": request.lora or model, "prompt": list(request.prompt_token_ids),
            "max_tokens": request.output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


def engine_payload(request: ServingRequest) -> dict[str, Any]:
    """Body of a streamed /generate request to an engine server."""
    return {"prompt_token_ids": list(request.prompt_token_ids),
            "params": {"max_tokens": request.output_len, "temperature": 0, "ignore_eos": True},
            "lora": request.lora, "cache_salt": None, "priority": 0, "stream": True}


async def _openai_stream(lines: AsyncIterator[str], timer: _Timer) -> int:
    """Consume SSE lines; returns the output token count. Raises StreamError on an error
    event or a stream that ends before [DONE]."""
    chunks, usage_tokens = 0, None
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return usage_tokens if usage_tokens is not None else chunks
        event = json.loads(data)
        if event.get("error"):
            raise StreamError("ServerError", _message(event["error"]))
        choices = event.get("choices")
        if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
            timer.token_chunk()
            chunks += 1
        if usage := event.get("usage"):
            usage_tokens = int(usage["completion_tokens"])
    raise StreamError("Truncated", "stream ended before [DONE]")


async def _engine_stream(lines: AsyncIterator[str], timer: _Timer) -> int:
    """Consume NDJSON lines; returns completion_tokens of the finished object."""
    counted = 0
    async for line in lines:
        if not line.strip():
            continue
        event = json.loads(line)
        if event.get("error"):
            raise StreamError("ServerError", _message(event["error"]))
        if ids := event.get("delta_token_ids"):
            timer.token_chunk()
            counted += len(ids)
        if event.get("finished"):
            return int(event.get("completion_tokens") or counted)
    raise StreamError("Truncated", "stream ended before a finished object")


def _message(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message", error))[:_MAX_ERROR_CHARS]
    return str(error)[:_MAX_ERROR_CHARS]


async def send_request(client: httpx.AsyncClient, protocol: Protocol, base_url: str,
                       request: ServingRequest, model: str | None, start_s: float
                       ) -> RequestRecord:
    """Send one streamed request and time it; ``start_s`` is its offset in the run."""
    if protocol == "openai":
        if model is None:
            raise ValueError("the openai protocol needs a model name")
        url, body = f"{base_url}/v1/completions", openai_payload(request, model)
        parse: Callable[[AsyncIterator[str], _Timer], Any] = _openai_stream
    else:
        url, body, parse = f"{base_url}/generate", engine_payload(request), _engine_stream
    timer = _Timer()
    status: int | None = None
    try:
        async with client.stream("POST", url, json=body) as response:
            status = response.status_code
            if status != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestRecord(False, request.prompt_len, start_s=start_s,
                                     e2e_s=time.perf_counter() - timer.start,
                                     status_code=status, error=_error_text(text))
            output_tokens = await parse(response.aiter_lines(), timer)
    except Exception as exc:  # any failure is this request's, never the run's
        error = str(exc) if isinstance(exc, StreamError) else f"{type(exc).__name__}: {exc}"
        return RequestRecord(False, request.prompt_len, start_s=start_s,
                             e2e_s=time.perf_counter() - timer.start, status_code=status,
                             error=error[:_MAX_ERROR_CHARS])
    return timer.record(request, output_tokens, start_s)


def _error_text(body: str) -> str:
    """The message of an OpenAI-style error body, else the body's head."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:_MAX_ERROR_CHARS]
    if isinstance(parsed, dict) and "error" in parsed:
        return _message(parsed["error"])
    if isinstance(parsed, dict) and "detail" in parsed:
        return _message(parsed["detail"])
    return body[:_MAX_ERROR_CHARS]


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The id of the first entry of GET {base}/v1/models."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    entries = response.json().get("data") or []
    if not entries:
        raise ValueError(f"{base_url}/v1/models lists no models; pass a model name")
    return str(entries[0]["id"])
