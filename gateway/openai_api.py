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
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from transformers import PreTrainedTokenizerBase

from engine.http_errors import ApiError
from gateway.auth import Principal
from gateway.config import GatewayConfig
from gateway.engine_client import ACCEPTED
from gateway.exposure import instance_tag
from gateway.openai_format import ResponseFormatter
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.service import Gateway, Job

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
    """Routes over the gateway the app builds at startup (hence the getter)."""
    router = APIRouter()

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
        gateway = get_gateway()
        if isinstance(body.prompt, str):
            prompt_ids = list(tokenizer(body.prompt)["input_ids"])
        else:
            prompt_ids = [int(t) for t in body.prompt]
        job = _job(gateway, body, principal, prompt_ids, body.max_tokens, body.logprobs,
                   "completions")
        return await _respond(gateway, job, principal, body, request,
                              ResponseFormatter("completions", body.model, tokenizer,
                                                body.logprobs))

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               principal: Caller) -> Response:
        gateway = get_gateway()
        try:
            prompt_ids = _apply_chat_template(tokenizer, body.template_messages())
        except ValueError as exc:
            raise ApiError(400, f"chat template failed: {exc}", param="messages") from None
        top = (body.top_logprobs or 0) if body.logprobs else None
        job = _job(gateway, body, principal, prompt_ids, body.requested_max_tokens(), top,
                   "chat")
        return await _respond(gateway, job, principal, body, request,
                              ResponseFormatter("chat", body.model, tokenizer, top))

    return router


def _apply_chat_template(tokenizer: PreTrainedTokenizerBase,
                         messages: list[dict[str, str]]) -> list[int]:
    if tokenizer.chat_template is None:
        raise ValueError("the model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return [int(t) for t in ids]  # type: ignore[arg-type]


def _job(gateway: Gateway, body: SamplingFields, principal: Principal, prompt_ids: list[int],
         max_tokens: int | None, logprobs: int | None, endpoint: str) -> Job:
    adapter = gateway.resolve_model(body.model, principal)
    if not prompt_ids:
        raise ApiError(400, "prompt is empty after tokenization", param="prompt")
    context = gateway.max_model_len()
    if context and len(prompt_ids) >= context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the "
                       f"prompt has {len(prompt_ids)} tokens", code="context_length_exceeded",
                       param="messages" if endpoint == "chat" else "prompt")
    if max_tokens is None:  # chat default: whatever the context (or KV capacity) leaves
        room = gateway.max_request_tokens() or context
        max_tokens = max(1, room - len(prompt_ids)) if room else 16
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k or 0, "seed": body.seed, "stop": body.stop_list(),
        "ignore_eos": body.ignore_eos, "logprobs": logprobs,
    }
    return Job(prompt_token_ids=prompt_ids, params=params, adapter=adapter,
               cache_salt=gateway.cache_salt(principal, body.cache_salt),
               priority=gateway.priority(principal, body.priority), endpoint=endpoint)


async def _respond(gateway: Gateway, job: Job, principal: Principal, body: SamplingFields,
                   request: Request, fmt: ResponseFormatter) -> Response:
    adapter_label = job.adapter or "base"
    stream = gateway.stream(job)
    try:
        await gateway.admit(job, principal)
        first = await _next_or_disconnect(request, anext(stream))
    except ApiError as exc:
        gateway.settle(job, 0, reached_engine=False)
        gateway.metrics.requests.labels(job.endpoint, str(exc.status), adapter_label,
                                        job.instance_id or "none").inc()
        raise
    assert first is ACCEPTED
    headers = _route_headers(job, gateway.config)
    if body.stream:
        return EventSourceResponse(_sse(gateway, job, stream, fmt, body.include_usage),
                                   headers=headers)
    try:
        result = await _next_or_disconnect(request, _collect(gateway, job, stream, fmt))
    except ApiError as exc:
        gateway.metrics.requests.labels(job.endpoint, str(exc.status), adapter_label,
                                        job.instance_id or "none").inc()
        raise
    finally:
        gateway.settle(job, fmt.prompt_tokens + fmt.completion_tokens, reached_engine=True)
    gateway.metrics.requests.labels(job.endpoint, "200", adapter_label,
                                    job.instance_id or "none").inc()
    return JSONResponse(result, headers=headers)


def _route_headers(job: Job, config: GatewayConfig) -> dict[str, str]:
    """The request id, the serving instance's opaque id (never its URL) and, with
    debug_headers only, the routing decision (engine URLs and every instance's score)."""
    headers = {"x-request-id": job.request_id}
    if job.decision is not None:
        headers["x-loragate-instance"] = instance_tag(job.decision.instance_id,
                                                      config.admin_key)
        if config.debug_headers:
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
                error = chunk["error"]
                code = error.get("code") or "engine_error"
                status = ERROR_STATUS.get(code, 500)
                raise ApiError(status, error["message"], code=code, headers=(
                    {"Retry-After": str(gateway.config.retry_after_s)} if status in (429, 503)
                    else None))
            fmt.add(chunk)
        timer.done()
    return fmt.final()


async def _sse(gateway: Gateway, job: Job, stream: AsyncGenerator[dict[str, Any], None],
               fmt: ResponseFormatter, include_usage: bool) -> AsyncIterator[bytes]:
    status = "200"
    try:
        async with contextlib.aclosing(stream):
            timer = _Timer(gateway, job)
            async for chunk in stream:
                timer.tick(chunk)
                if chunk.get("error"):
                    status = "500"
                    yield _event({"error": {"code": "engine_error", **chunk["error"]}})
                    break
                for event in fmt.stream_events(chunk, include_usage):
                    yield _event(event)
            timer.done()
            if include_usage and status == "200":
                yield _event(fmt.usage_event())
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        status = "499"
        raise
    finally:
        gateway.settle(job, fmt.prompt_tokens + fmt.completion_tokens, reached_engine=True)
        gateway.metrics.requests.labels(job.endpoint, status, job.adapter or "base",
                                        job.instance_id or "none").inc()


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


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
