"""The engine protocol: what a gateway sends an engine and what comes back, typed once.

One schema for both ways of reaching an engine: the in-process AsyncEngine and the engine's
HTTP API (engine/http/server.py, whose bodies and NDJSON lines are these types' JSON). A
gateway talks to either through ``EngineClient``:

    stream = await client.open(GenerateRequest(...))   # raises before the first byte
    async for chunk in stream: ...                     # StreamChunk until one is final

``open`` raising means nothing was generated anywhere, so the request may be sent to
another engine (EngineUnavailable) or passed back to its caller (EngineRejected); once it
returned, a failure ends the stream with a chunk carrying an EngineError, or with
EngineStreamBroken when the engine itself went away.

Errors carry a code; ``ERROR_STATUS`` is the one table from codes to the HTTP status an
error is answered with, and ``ERROR_TYPES`` from statuses to OpenAI's error types.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from engine.generation_defaults import SamplingDefaults
from engine.prompt_logprobs import PromptLogprob
from engine.sampling_params import SamplingParams
from lora.adapter_info import AdapterInfo
from prefix_cache.cache import PrefixUpdate

ERROR_STATUS: dict[str, int] = {
    "invalid_request": 400,
    "not_found": 404,
    "adapter_in_use": 409,
    "adapter_changed": 409,
    "overloaded": 429,
    "engine_error": 500,
    "adapter_load_failed": 500,
    "stream_broken": 502,
    "unavailable": 503,
    "draining": 503,
    "shutting_down": 503,
    "adapter_busy": 503,
    "timeout": 504,
}
"""Error code -> HTTP status (the status of a response that ends in this error)."""

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
    413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
    502: "server_error", 503: "service_unavailable", 504: "timeout_error"}
"""HTTP status -> the ``type`` of OpenAI's error schema (a 404, such as model_not_found, is
an invalid_request_error there too)."""


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error")


class EngineError(Exception):
    """A request's or a command's failure: a message safe to show its caller (no paths, no
    exception names, nothing about other requests), a code and the status it maps to."""

    def __init__(self, message: str, code: str | None = "engine_error",
                 status: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status or ERROR_STATUS.get(code or "", 500)
        self.param = param

    @property
    def type(self) -> str:
        return error_type(self.status)

    def to_json(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "code": self.code,
                "param": self.param, "status": self.status}

    @classmethod
    def from_json(cls, data: dict[str, Any], status: int | None = None) -> EngineError:
        """From a chunk's ``error`` or an HTTP error body's ``error`` (with its status)."""
        code = data.get("code")
        param = data.get("param")
        given = data.get("status")
        return cls(str(data.get("message") or "the request failed"),
                   code if isinstance(code, str) else None,
                   status or (given if isinstance(given, int) else None),
                   param if isinstance(param, str) else None)


class EngineUnavailable(EngineError):
    """The engine could not take the request or command (gone, draining, dead, a refused
    engine token): nothing ran, so another instance may serve it."""

    def __init__(self, message: str, code: str = "unavailable") -> None:
        super().__init__(message, code)


class EngineRejected(EngineError):
    """The engine refused the request itself (4xx): the caller's fault, the same answer
    anywhere, so it is passed on and never retried."""


class EngineStreamBroken(EngineError):
    """An accepted stream ended without a final chunk (the engine went away)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "stream_broken")


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: token ids in, chunks out. ``deadline`` (unix time, seconds) is when
    the engine stops working on it: it is aborted and its stream ends with a timeout.
    ``tenant`` is whom the engine is fair to in work done before admission (compiling a
    grammar, spelling bad words): each tenant's such work queues behind its own, not
    another's (the gateway names a caller without a tenant by its address); None: one
    shared turn. ``adapter_digest``: the weights the caller means by
    ``adapter``; an engine that holds other weights under that name (or none) refuses the
    request with code "adapter_changed" rather than run it on them (None: any)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    deadline: float | None = None
    tenant: str | None = None
    adapter_digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        params = {f.name: getattr(self.params, f.name) for f in fields(SamplingParams)
                  if f.name != "n"}
        structured = self.params.structured
        return {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                "params": {**params, "stop": list(self.params.stop),
                           "stop_token_ids": list(self.params.stop_token_ids),
                           "structured": None if structured is None else structured.to_json()},
                "lora": self.adapter, "cache_salt": self.cache_salt,
                "priority": self.priority, "deadline": self.deadline, "tenant": self.tenant,
                "lora_digest": self.adapter_digest}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateRequest:
        """From a validated engine HTTP body (engine/http/bodies.py); ValueError or
        TypeError for sampling parameters SamplingParams refuses."""
        deadline = data.get("deadline")
        if deadline is not None and not math.isfinite(deadline):
            raise ValueError(f"deadline must be a finite unix time, got {deadline!r}")
        return cls(request_id=data["request_id"],
                   prompt_token_ids=list(data["prompt_token_ids"]),
                   params=SamplingParams(**data.get("params", {})),
                   adapter=data.get("lora"), cache_salt=data.get("cache_salt"),
                   priority=int(data.get("priority", 0)), deadline=deadline,
                   tenant=data.get("tenant"), adapter_digest=data.get("lora_digest"))


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """What one request produced since its previous chunk; the last one has
    ``finish_reason`` set ("stop", "length", "abort", or "error" with ``error``).

    ``logprobs`` holds one {token id: logprob} map per new token (None unless asked for);
    ``prompt_logprobs`` one entry per prompt position (None at the first), on one chunk only
    (the first that carries a token) and only when asked for; ``prompt_tokens`` /
    ``completion_tokens`` are the request's usage so far, ``cached_tokens`` the prompt
    tokens it read from the prefix cache (0 until it was admitted)."""

    request_id: str
    delta_token_ids: list[int]
    delta_text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    error: EngineError | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None
    cached_tokens: int = 0
    stop_reason: int | str | None = None
    """On the last chunk of a request that finished with "stop": the stop string or
    stop_token_ids entry that ended it (None: an end-of-sequence token)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failed(cls, request_id: str, error: EngineError, prompt_tokens: int = 0,
               completion_tokens: int = 0) -> StreamChunk:
        """A final chunk that ends a request with an error."""
        return cls(request_id, [], "", prompt_tokens, completion_tokens, "error", None, error)

    def to_json(self) -> dict[str, Any]:
        logprobs = None if self.logprobs is None else [
            {str(token): value for token, value in step.items()} for step in self.logprobs]
        return {"request_id": self.request_id, "delta_text": self.delta_text,
                "delta_token_ids": self.delta_token_ids, "finished": self.finished,
                "finish_reason": self.finish_reason, "logprobs": logprobs,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "stop_reason": self.stop_reason,
                "error": None if self.error is None else self.error.to_json(),
                "prompt_logprobs": None if self.prompt_logprobs is None else [
                    None if p is None else {"token_id": p.token_id, "logprob": p.logprob,
                                            "rank": p.rank, "top": [list(t) for t in p.top]}
                    for p in self.prompt_logprobs]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StreamChunk:
        """From an NDJSON line of the engine's stream (KeyError / ValueError / TypeError
        when it is not one)."""
        logprobs = data.get("logprobs")
        scored = data.get("prompt_logprobs")
        error = data.get("error")
        finish = data.get("finish_reason")
        stop_reason = data.get("stop_reason")
        if not isinstance(stop_reason, (int, str)) or isinstance(stop_reason, bool):
            stop_reason = None
        if data.get("finished") and finish is None:
            finish = "error" if error else "stop"
        return cls(
            str(data["request_id"]), [int(t) for t in data.get("delta_token_ids") or []],
            str(data.get("delta_text") or ""), int(data.get("prompt_tokens") or 0),
            int(data.get("completion_tokens") or 0), finish,
            None if logprobs is None else [{int(k): float(v) for k, v in step.items()}
                                           for step in logprobs],
            None if not error else EngineError.from_json(error),
            None if scored is None else [
                None if p is None else PromptLogprob(
                    int(p["token_id"]), float(p["logprob"]), int(p["rank"]),
                    tuple((int(t), float(lp)) for t, lp in p["top"]))
                for p in scored],
            int(data.get("cached_tokens") or 0), stop_reason)


class ChunkStream:
    """The chunks of one admitted request, as ``open()`` returns them. Closing it before
    the final chunk, whether or not a chunk was read, ends the request where it runs
    (``cancel``; a started iterator does that itself when closed)."""

    def __init__(self, chunks: AsyncGenerator[StreamChunk, None],
                 cancel: Callable[[], None]) -> None:
        self._chunks = chunks
        self._cancel = cancel
        self._started = False

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> StreamChunk:
        self._started = True
        return await anext(self._chunks)

    async def aclose(self) -> None:
        if not self._started:
            self._started = True  # once
            self._cancel()
        await self._chunks.aclose()


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter an engine registered: its name, the digest of its weights, its rank."""

    name: str
    digest: str
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "rank": self.rank}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoadedAdapter:
        return cls(str(data["name"]), str(data["digest"]), int(data["rank"]))


@dataclass(frozen=True)
class PoolSummary:
    """One KV pool (an adapter's, or "base") as /state reports it."""

    used_blocks: int
    cached_blocks: int
    evictions: int
    hit_rate: float


@dataclass(frozen=True)
class EngineState:
    """An engine's load, limits, adapters and the prefix hashes it published since a
    cursor: everything a gateway routes by, in one answer."""

    instance_id: str
    model: str
    draining: bool
    in_flight: int
    """Requests whose stream is open."""
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks_used: int
    kv_blocks_total: int
    max_loras: int
    max_lora_rank: int
    max_num_seqs: int
    block_size: int
    publish_every: int
    max_model_len: int
    max_request_tokens: int
    """Prompt + output one request can hold (the context, or the KV capacity if smaller)."""
    prefix_hit_rate: float
    kv_pools: dict[str, PoolSummary]
    adapters: list[AdapterInfo]
    prefix: PrefixUpdate
    kv_events: tuple[str, str | None] | None = None
    """(events endpoint, replay endpoint) as the engine was configured, when it publishes
    KV events (engine/kv_events.py); a wildcard host means the engine's own."""
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    """The model's recommended sampling (engine/generation_defaults.py): what the gateway
    gives a request that leaves those fields unset."""

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["kv_pools"] = {name: vars(pool) for name, pool in self.kv_pools.items()}
        data["adapters"] = [vars(a) for a in self.adapters]
        data["sampling_defaults"] = self.sampling_defaults.to_json()
        p = self.prefix
        data["prefix"] = {"cursor": p.cursor, "full": p.full,
                          "added": [format(h, "x") for h in p.added],
                          "removed": [format(h, "x") for h in p.removed]}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineState:
        """KeyError / ValueError / TypeError when a field is missing or malformed."""
        values = {f.name: data[f.name] for f in fields(cls)
                  if f.name not in ("kv_events", "sampling_defaults")}
        raw = data.get("sampling_defaults")
        values["sampling_defaults"] = SamplingDefaults.from_json(
            raw if isinstance(raw, dict) else {})
        events = data.get("kv_events")
        values["kv_events"] = None if not events else (str(events[0]), events[1] and
                                                       str(events[1]))
        values["kv_pools"] = {str(name): PoolSummary(**pool)
                              for name, pool in data["kv_pools"].items()}
        values["adapters"] = [AdapterInfo(**a) for a in data["adapters"]]
        prefix = data["prefix"]
        values["prefix"] = PrefixUpdate(
            cursor=int(prefix["cursor"]), full=bool(prefix["full"]),
            added=[int(h, 16) for h in prefix["added"]],
            removed=[int(h, 16) for h in prefix["removed"]])
        return cls(**values)


class EngineClient(Protocol):
    """One engine, as the gateway drives it: the in-process AsyncEngine or an engine
    server over HTTP (gateway/engine_client.py). Every method raises EngineUnavailable when
    the engine cannot be reached and EngineRejected when it refuses."""

    async def open(self, request: GenerateRequest) -> ChunkStream:
        """Admit the request; the chunks follow. Closing the iterator early aborts it."""
        ...

    async def abort(self, request_id: str) -> bool:
        """End a request and free its blocks; False when the engine does not know it."""
        ...

    async def state(self, cursor: int = 0) -> EngineState:
        """Answered between steps (what it reports is consistent): a long step delays it."""
        ...

    async def alive(self) -> bool:
        """Whether the engine answers at all, without waiting for its step to end: a busy
        engine whose state call timed out is alive, a frozen or cut-off one is not."""
        ...

    async def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        """Validate and register a PEFT directory (replacing an idle adapter of that name
        with other weights; EngineRejected code "adapter_in_use" while one runs)."""
        ...

    async def unload_adapter(self, name: str, digest: str | None = None) -> None:
        """Unregister an adapter: 404 if unknown, 409 while a request uses it. With
        ``digest``, only those weights: another adapter of that name is left alone (404)."""
        ...

    async def pin_adapter(self, name: str, pinned: bool) -> None: ...
