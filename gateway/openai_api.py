"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Streaming responses are SSE in OpenAI's chunk format, ending with ``data: [DONE]``; with
``stream_options.include_usage`` every chunk carries ``"usage": null`` and one last chunk
with no choices carries the usage. Errors found before the first byte (bad body, unknown
model, prompt too long, no capacity) are HTTP errors in OpenAI's schema; an engine failure
after the stream started is an ``error`` event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from engine.http_errors import ApiError
from gateway.auth import Principal
from gateway.engine_client import ACCEPTED
from gateway.openai_format import Endpoint, ResponseFormatter
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.prompts import PromptEncoder
from gateway.service import Claim, Gateway, Job, Outcome

DISCONNECT_POLL_S = 0.25


async def _caller(request: Request) -> Principal:
    """Runs before the body is validated, so a missing key is a 401 first."""
    gateway: Gateway = request.app.state.gateway
    return await gateway.authenticate(request)


Caller = Annotated[Principal, Depends(_caller)]
ERROR_STATUS = {"timeout": 504, "unavailable": 503, "overloaded": 429}
"""HTTP status of a non-streamed response whose stream ended in an error chunk, by code
(default 500)."""


def build_router(get_gateway: Callable[[], Gateway], tokenizer: PreTrainedTokenizerBase
                 ) -> APIRouter:
    """Routes over the gateway the app builds at startup (hence the getter). The router owns
    the prompt encoder and its tokenizer threads (gateway/prompts.py)."""
    router = APIRouter()
    prompts = PromptEncoder(tokenizer)

    @router.get("/v1/models")
    async def list_models(principal: Caller) -> dict[str, Any]:
        gateway = get_gateway()
        created = int(time.time())
        base = {"id": gateway.base_model, "object": "model", "created": created,
                "owned_by": "loragate", "root": gateway.base_model, "parent": None}
        adapters = [{"id": name, "object": "model", "created": created,
                     "owned_by": "loragate", "root": name, "parent": gateway.base_model}
                    for name in gateway.adapter_names(principal)]
        return {"object": "list", "data": [base, *adapters]}

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request,
                          principal: Caller) -> Response:
        async def encode(context: int) -> list[int]:
            if not isinstance(body.prompt, str):  # ids (a text list became its one text)
                return cast(list[int], body.prompt)  # bounded by the context in _job
            PromptEncoder.check_chars(len(body.prompt), context, "prompt")
            return await prompts.encode_prompt(body.prompt)

        fmt = ResponseFormatter("completions", body.model, tokenizer, body.logprobs)
        return await _serve(get_gateway(), _Call(body, request, principal, "completions",
                                                    body.max_tokens, "max_tokens",
                                                    body.logprobs), encode, fmt)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               principal: Caller) -> Response:
        async def encode(context: int) -> list[int]:
            PromptEncoder.check_chars(body.prompt_chars(), context, "messages")
            return await prompts.encode_chat(body.template_messages())

        top = (body.top_logprobs or 0) if body.logprobs else None
        fmt = ResponseFormatter("chat", body.model, tokenizer, top)
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        return await _serve(get_gateway(), _Call(body, request, principal, "chat",
                                                    body.requested_max_tokens(), param, top),
                            encode, fmt)

    return router


@dataclass(frozen=True)
class _Call:
    """What _serve needs of one validated request besides its prompt."""

    body: SamplingFields
    http: Request
    principal: Principal
    endpoint: Endpoint
    max_tokens: int | None
    max_tokens_param: str
    logprobs: int | None


async def _serve(gateway: Gateway, req: _Call,
                 encode: Callable[[int], Awaitable[list[int]]], fmt: ResponseFormatter
                 ) -> Response:
    """Admit, then the expensive work (tokenizing), then dispatch. The claim taken at
    admission is settled exactly once whatever happens: here for anything raised before a
    response exists, else by the response (see _respond)."""
    claim = await gateway.admit(req.principal)
    label = "none"  # the adapter, once the model resolved
    try:
        adapter = gateway.resolve_model(req.body.model, req.principal)
        label = adapter or "base"
        context = gateway.context_length()
        prompt_ids = await encode(context)
        job = _job(gateway, claim, req, adapter, prompt_ids, context)
        await gateway.limiter.reserve(claim.ticket, len(prompt_ids) + job.params["max_tokens"])
        return await _respond(gateway, job, req, fmt)
    except BaseException as exc:
        gateway.settle(claim, 0, _outcome(exc))
        status = exc.status if isinstance(exc, ApiError) else \
            499 if isinstance(exc, asyncio.CancelledError) else 500
        gateway.metrics.requests.labels(req.endpoint, str(status), label, "none").inc()
        raise


def _outcome(exc: BaseException) -> Outcome:
    """A refused request still counts against its tenant; one the gateway could not serve
    (no capacity, engine failure, a bug) is refunded."""
    if isinstance(exc, ApiError):
        return "failed" if exc.status >= 500 or exc.code == "overloaded" else "refused"
    return "refused" if isinstance(exc, asyncio.CancelledError) else "failed"


def _job(gateway: Gateway, claim: Claim, req: _Call, adapter: str | None,
         prompt_ids: list[int], context: int) -> Job:
    body = req.body
    param = "messages" if req.endpoint == "chat" else "prompt"
    if not prompt_ids:
        raise ApiError(400, "prompt is empty after tokenization", param=param)
    if len(prompt_ids) >= context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the "
                       f"prompt has {len(prompt_ids)} tokens", code="context_length_exceeded",
                       param=param)
    max_tokens = req.max_tokens
    if max_tokens is None:  # chat default: whatever the context (or KV capacity) leaves
        room = gateway.max_request_tokens() or context
        max_tokens = max(1, room - len(prompt_ids))
    elif len(prompt_ids) + max_tokens > context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; you "
                       f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} "
                       f"in the prompt, {max_tokens} for the completion)",
                       code="context_length_exceeded", param=req.max_tokens_param)
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": max(0, body.top_k or 0),  # -1 (vLLM's "off") is the engine's 0
        "seed": body.seed, "stop": body.stop_list(),
        "ignore_eos": body.ignore_eos, "logprobs": req.logprobs,
    }
    return Job(prompt_token_ids=prompt_ids, params=params, adapter=adapter,
               cache_salt=gateway.cache_salt(req.principal, body.cache_salt),
               priority=gateway.priority(req.principal, body.priority), endpoint=req.endpoint,
               claim=claim)


async def _respond(gateway: Gateway, job: Job, req: _Call, fmt: ResponseFormatter
                   ) -> Response:
    """Dispatch; errors before the engine took the job propagate to _serve. From then on
    the response settles the claim as served: a whole response here, a stream when it ends
    (_ClosingStream)."""
    stream = gateway.stream(job)
    first = await _next_or_disconnect(req.http, anext(stream))
    assert first is ACCEPTED
    headers = _route_headers(job)

    def settle() -> None:
        gateway.settle(job.claim, fmt.prompt_tokens + fmt.completion_tokens, "served",
                       job.adapter)

    if req.body.stream:
        events = _sse(gateway, job, stream, fmt, req.body.include_usage)
        return _ClosingStream(events, stream, settle, headers=headers)
    try:
        result = await _next_or_disconnect(req.http, _collect(gateway, job, stream, fmt))
    finally:
        settle()
        await stream.aclose()  # normally closed by _collect; not if it never started
    gateway.metrics.requests.labels(job.endpoint, "200", job.adapter or "base",
                                    job.instance_id or "none").inc()
    return JSONResponse(result, headers=headers)


class _ClosingStream(EventSourceResponse):
    """An SSE response that closes its generators and settles its claim when it ends,
    however it ends: a client that leaves while an event is being sent would otherwise
    leave them suspended (engine request running, claim held) until garbage collection,
    and a response that never started would never settle."""

    def __init__(self, events: AsyncGenerator[bytes, None],
                 stream: AsyncGenerator[dict[str, Any], None], settle: Callable[[], None],
                 headers: dict[str, str]) -> None:
        super().__init__(events, headers=headers)
        self._generators = (events, stream)
        self._settle = settle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                for generator in self._generators:
                    await generator.aclose()
            finally:
                self._settle()


def _route_headers(job: Job) -> dict[str, str]:
    headers = {"x-request-id": job.request_id}
    if job.decision is not None:
        headers["x-loragate-instance"] = job.decision.instance_id
        headers["x-loragate-route"] = job.decision.explain()
    return headers


async def _next_or_disconnect(request: Request, awaitable: Any) -> Any:
    """Await while watching the client: a disconnect cancels the work (which aborts the
    request on its engine) instead of finishing it for nobody."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise ApiError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()


async def _collect(gateway: Gateway, job: Job, stream: AsyncGenerator[dict[str, Any], None],
                   fmt: ResponseFormatter) -> dict[str, Any]:
    async with contextlib.aclosing(stream):
        timer = _Timer(gateway, job)
        async for chunk in stream:
            timer.tick(chunk)
            if chunk.get("error"):
                error = _own_error(chunk["error"])
                code = error["code"]
                status = ERROR_STATUS.get(code, 500)
                raise ApiError(status, error["message"], code=code, headers=(
                    {"Retry-After": str(gateway.config.retry_after_s)} if status in (429, 503)
                    else None))
            fmt.add(chunk)
        timer.done()
    return fmt.final()


async def _sse(gateway: Gateway, job: Job, stream: AsyncGenerator[dict[str, Any], None],
               fmt: ResponseFormatter, include_usage: bool) -> AsyncGenerator[bytes, None]:
    status = "200"
    try:
        async with contextlib.aclosing(stream):
            timer = _Timer(gateway, job)
            async for chunk in stream:
                timer.tick(chunk)
                if chunk.get("error"):
                    status = "500"
                    yield _event({"error": _own_error(chunk["error"])})
                    break
                for event in fmt.stream_events(chunk, include_usage):
                    yield _event(event)
            timer.done()
            if include_usage and status == "200":
                yield _event(fmt.usage_event())
        yield b"data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        status = "499"
        raise
    finally:
        gateway.settle(job.claim, fmt.prompt_tokens + fmt.completion_tokens, "served",
                       job.adapter)
        gateway.metrics.requests.labels(job.endpoint, status, job.adapter or "base",
                                        job.instance_id or "none").inc()


def _own_error(error: dict[str, Any]) -> dict[str, str]:
    """The error event of this request's stream: its own message, type and code only (the
    fields OpenAI's schema has; nothing else an engine chunk might carry is passed on)."""
    return {"message": str(error.get("message") or "the request failed"),
            "type": str(error.get("type") or "server_error"),
            "code": str(error.get("code") or "engine_error")}


def _event(payload: dict[str, Any]) -> bytes:
    # allow_nan=False: a bare NaN is not JSON; the formatter makes every float finite, so
    # this fails loudly rather than send what clients cannot parse.
    return b"data: " + json.dumps(payload, separators=(",", ":"), allow_nan=False
                                  ).encode() + b"\n\n"


class _Timer:
    """TTFT / ITL / E2E as the client sees them (from the gateway's arrival time)."""

    def __init__(self, gateway: Gateway, job: Job) -> None:
        self.metrics = gateway.metrics
        self.arrival = job.arrival
        self.last: float | None = None

    def tick(self, chunk: dict[str, Any]) -> None:
        if not chunk.get("delta_token_ids"):
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def done(self) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
