"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Streaming responses are SSE in OpenAI's chunk format, ending with ``data: [DONE]``; with
``stream_options.include_usage`` every chunk carries ``"usage": null`` and one last chunk
with no choices carries the usage (with vLLM's ``continuous_usage_stats`` every chunk
carries the usage so far instead of null). Errors found before the first byte (bad body, unknown
model, prompt too long, no capacity) are HTTP errors in OpenAI's schema; an engine failure
after the stream started is an ``error`` event followed by ``[DONE]``.

A generation's cheap checks come first, the expensive work after them: the key and admission
against the tenant's limits before the body is even read (gateway/admission.py; from here on
every request counts against its RPM, whatever becomes of it), the body (every field
bounded: openai_protocol), the prompt's length in
characters, tokenizing off the event loop (prompts), its length in tokens, the tenant's
token reservation, then dispatch (service).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from transformers import PreTrainedTokenizerBase

from engine.http.disconnect import next_or_disconnect
from engine.http.errors import ApiError
from engine.invalid_field import field_of
from engine.protocol import ChunkStream, GenerateRequest
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from gateway.access_log import AccessRecord, record_of
from gateway.admission import Admitted, AdmittedRoute
from gateway.auth import Principal
from gateway.batch_stream import BatchStream
from gateway.cache_key_affinity import affinity_key
from gateway.caller import Caller, turn_of
from gateway.config import GatewayConfig
from gateway.exposure import instance_tag
from gateway.info_api import build_info_router
from gateway.job import Claim, Job, Outcome, new_request_id
from gateway.openai_chat_protocol import ChatCompletionRequest
from gateway.openai_completions_protocol import CompletionRequest
from gateway.openai_format import PromptEcho, ResponseFormatter
from gateway.openai_protocol import RANDOM_SEED, SEED_LIMIT, SamplingFields
from gateway.openai_stream import ClosingStream, collect, sse
from gateway.prompts import PromptEncoder
from gateway.responses_api import RESPONSES_PATH, build_responses_router
from gateway.service import Gateway
from gateway.token_bytes import TokenBytes


def build_router(get_gateway: Callable[[], Gateway], tokenizer: PreTrainedTokenizerBase
                 ) -> APIRouter:
    """Routes over the gateway the app builds at startup (hence the getter). The router owns
    the prompt encoder and its tokenizer threads (gateway/prompts.py)."""
    router = APIRouter(route_class=AdmittedRoute)  # the generation routes admit first
    prompts_encoder = PromptEncoder(tokenizer)
    token_bytes = TokenBytes(tokenizer)  # one cache for every request's logprob bytes

    router.include_router(build_info_router(get_gateway, prompts_encoder))

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, principal: Caller,
                          claim: Admitted) -> Response:
        async def encode(context: int) -> list[PromptEcho]:
            keep = _kept_tokens(body, context)
            truncating = keep is not None
            prompts = []
            for prompt in body.prompt:
                if not isinstance(prompt, str):  # ids, bounded by the context in _fitting
                    ids = prompt if keep is None else prompt[-keep:]
                else:
                    if not truncating:  # else longer is fine: it will be cut
                        prompts_encoder.check_chars(len(prompt), context, "prompt")
                    ids = await prompts_encoder.encode_prompt(prompt, body.add_special_tokens,
                                                              keep)
                echo = _fitting(ids, context, "prompt")
                # The echo is the text as sent, or what the engine runs when that differs.
                echo.text = "" if not body.echo else prompt if isinstance(prompt, str) and \
                    not truncating else str(tokenizer.decode(ids))
                prompts.append(echo)
            return prompts

        body.model = body.model or get_gateway().base_model
        fmt = ResponseFormatter("completions", body.model, tokenizer, body.logprobs,
                                body.return_token_ids, body.return_tokens_as_token_ids,
                                token_bytes, echo=body.echo,
                                prompt_logprobs=body.prompt_logprobs,
                                drop_output=body.max_tokens == 0, keep=body.n,
                                skip_special_tokens=body.skip_special_tokens)
        call = _Call(body, request, principal, claim, "completions",
                     body.max_tokens or (1 if body.max_tokens == 0 else None), "max_tokens",
                     body.engine_logprobs(), body.engine_prompt_logprobs(),
                     body.structured_output())
        return await _serve(get_gateway(), call, encode, fmt)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               principal: Caller, claim: Admitted) -> Response:
        async def encode(context: int) -> list[PromptEcho]:
            ids = await prompts_encoder.encode_chat_request(body, context,
                                                            _kept_tokens(body, context))
            prompt = _fitting(ids, context, "messages")
            prompt.text = body.echoed_text()
            return [prompt]

        top = (body.top_logprobs or 0) if body.logprobs else None
        body.model = body.model or get_gateway().base_model
        fmt = ResponseFormatter("chat", body.model, tokenizer, top, body.return_token_ids,
                                body.return_tokens_as_token_ids, token_bytes, echo=body.echo,
                                prompt_logprobs=body.prompt_logprobs, tools=body.tool_plan())
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        # The Responses API is served by this route (gateway/responses_api.py): its requests
        # are counted as its own.
        served_as = "responses" if request.url.path == RESPONSES_PATH else "chat"
        call = _Call(body, request, principal, claim, served_as, body.requested_max_tokens(),
                     param, top, body.prompt_logprobs, body.structured_constraint())
        return await _serve(get_gateway(), call, encode, fmt)

    router.include_router(build_responses_router(chat_completions))
    return router


@dataclass(frozen=True)
class _Call:
    """What _serve needs of one validated request besides its prompts."""

    body: SamplingFields
    http: Request
    principal: Principal
    claim: Claim
    """Taken by AdmittedRoute before the body was parsed."""
    endpoint: str
    """Its metrics label: completions, chat or responses."""
    max_tokens: int | None
    max_tokens_param: str
    logprobs: int | None
    prompt_logprobs: int | None = None
    constraint: StructuredOutput | None = None


async def _serve(gateway: Gateway, req: _Call,
                 encode: Callable[[int], Awaitable[list[PromptEcho]]], fmt: ResponseFormatter
                 ) -> Response:
    """The expensive work (tokenizing), then dispatch. The claim taken at admission
    (AdmittedRoute) is settled exactly once whatever happens: here for anything raised before a
    response exists, else by the response (see _respond). A batch of prompts is one
    admission, one claim and one response: a job (engine request) per prompt."""
    jobs: list[Job] = []
    access = record_of(req.http)
    if access is not None:
        access.tenant = req.principal.tenant_id
        access.end_user = req.body.user
        access.safety_identifier = req.body.safety_identifier

        def fill(record: AccessRecord) -> None:
            if jobs:
                prompt, record.completion_tokens = _used_tokens(
                    jobs, fmt, req.body.samples_per_prompt)
                record.prompt_tokens = prompt or sum(
                    len(job.request.prompt_token_ids) for job in jobs)
                record.first_token_at = jobs[0].first_token_at
        access.finish = fill
    claim = req.claim
    label = "none"  # the adapter, once the model resolved
    try:
        adapter = await gateway.resolve_or_load(req.body.model, req.principal)
        label = adapter or "base"
        if access is not None:
            access.adapter = label
        context = gateway.context_length()
        prompts = await encode(context)  # each checked to fit as it is tokenized
        k = req.body.samples_per_prompt
        jobs.extend(_job(gateway, claim, req, adapter, prompt.token_ids, context, sample)
                    for prompt in prompts for sample in range(k))
        fmt.start([prompt for prompt in prompts for _ in range(k)], k)
        # Each prompt once, as usage counts it: its samples share its computed blocks.
        prompt_tokens = sum(len(prompt.token_ids) for prompt in prompts)
        await gateway.limiter.reserve(
            claim.ticket, prompt_tokens + sum(_output_reserve(gateway, req, job) for job in jobs),
            prompt_tokens=None if req.max_tokens is not None else prompt_tokens)
        return await _respond(gateway, jobs, req, fmt)
    except BaseException as exc:
        gateway.settle(claim, 0, _outcome(exc))
        status = exc.status if isinstance(exc, ApiError) else \
            gateway.cancelled_status() if isinstance(exc, asyncio.CancelledError) else 500
        instance = jobs[0].instance_id if jobs else None
        gateway.metrics.requests.labels(req.endpoint, str(status), label,
                                        instance or "none").inc()
        raise


def _output_reserve(gateway: Gateway, req: _Call, job: Job) -> int:
    """The TPM a sequence reserves for its output (its prompt's come beside): its
    max_tokens, or, when the request set none, at most the configured share of the
    context it may fill."""
    output = job.request.params.max_tokens
    if req.max_tokens is None:
        output = min(output, gateway.config.tpm_unset_output_reserve)
    return output


def _outcome(exc: BaseException) -> Outcome:
    """A refused request still counts against its tenant; one the gateway could not serve
    (no capacity, engine failure, a bug) is refunded."""
    if isinstance(exc, ApiError):
        return "failed" if exc.status >= 500 or exc.code == "overloaded" else "refused"
    return "refused" if isinstance(exc, asyncio.CancelledError) else "failed"


def _kept_tokens(body: CompletionRequest | ChatCompletionRequest, context: int) -> int | None:
    """How many of a prompt's last tokens truncate_prompt_tokens keeps (None: all; -1: the
    context's worth less the one position the output needs). More than the context is a
    400, as in vLLM: such a prompt could not run."""
    keep = body.truncate_prompt_tokens
    if keep is not None and keep > context:
        raise ApiError(400, f"truncate_prompt_tokens ({keep}) is more than the model's "
                       f"context ({context} tokens)", param="truncate_prompt_tokens")
    return context - 1 if keep == -1 else keep  # one position left for the output


def _fitting(prompt_ids: list[int], context: int, param: str) -> PromptEcho:
    """A prompt's ids, if some room is left for the completion in the context: checked as
    soon as each prompt is tokenized, so a batch stops at its first prompt too long."""
    if not prompt_ids:
        raise ApiError(400, "prompt is empty after tokenization", param=param)
    if len(prompt_ids) >= context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the "
                       f"prompt has {len(prompt_ids)} tokens", code="context_length_exceeded",
                       param=param)
    return PromptEcho(prompt_ids)


def _job(gateway: Gateway, claim: Claim, req: _Call, adapter: str | None,
         prompt_ids: list[int], context: int, sample: int = 0) -> Job:
    """The engine request of one sequence: ``sample`` numbers the sequences of one prompt
    (n, best_of); a seeded request's j-th sequence draws with seed + j."""
    body = req.body
    max_tokens = req.max_tokens
    if max_tokens is not None and max_tokens > context:
        raise ApiError(400, f"{req.max_tokens_param} ({max_tokens}) is more than the model's "
                       f"maximum context length ({context} tokens)",
                       code="context_length_exceeded", param=req.max_tokens_param)
    # What the output may use: the context after the prompt, or less where the engines' KV
    # cache holds less for one request. A max_tokens past it is lowered to it, as vLLM
    # serves it (the answer then ends with finish_reason "length"); unset, chat's default.
    room = min(context, gateway.max_request_tokens() or context)
    if len(prompt_ids) >= room:  # the prompt fits the context (_fitting), not the KV cache
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) leaves no room for output "
                       f"in what one request can hold in the engines' KV cache ({room} "
                       "tokens): shorten the prompt", code="context_length_exceeded")
    left = room - len(prompt_ids)
    if body.min_tokens > left:  # else SamplingParams' message names a bound nobody sent
        raise ApiError(400, f"min_tokens ({body.min_tokens}) is more than the {left} tokens "
                       f"of output the context leaves after the prompt ({len(prompt_ids)} "
                       "tokens)", code="context_length_exceeded", param="min_tokens")
    max_tokens = left if max_tokens is None else min(max_tokens, left)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            seed=None if body.seed in (None, RANDOM_SEED) else (body.seed + sample) % SEED_LIMIT,
            stop=tuple(body.stop_list()), ignore_eos=body.ignore_eos,
            logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs,
            structured=req.constraint,
            **body.sampling_args(gateway.sampling_defaults()))
    except ValueError as exc:  # the edge bounds every field; this is the engine's own check
        raise ApiError(400, str(exc), param=field_of(exc)) from None
    request = GenerateRequest(
        new_request_id(), prompt_ids, params, adapter,
        gateway.cache_salt(req.principal, body.cache_salt),
        gateway.priority(req.principal, body.priority),
        deadline=time.time() + gateway.config.request_timeout_s,
        tenant=turn_of(req.principal, req.http))
    return Job(request, req.endpoint, claim, cache_key=affinity_key(
        request.cache_salt, adapter, body.prompt_cache_key))


async def _respond(gateway: Gateway, jobs: list[Job], req: _Call, fmt: ResponseFormatter
                   ) -> Response:
    """Dispatch; errors before the engines took every job propagate to _serve (the streams
    already opened are closed, aborting their requests). From then on the response settles
    the claim as served: a whole response here, a stream when it ends (ClosingStream)."""
    k = req.body.samples_per_prompt
    streams = await _open_all(gateway, jobs, req)
    job = jobs[0]
    # The tenant's limits as admission left them: read before settle() ends the ticket.
    limits = job.claim.ticket.headers() if job.claim.ticket is not None else {}

    def settle() -> None:
        gateway.settle(job.claim, sum(_used_tokens(jobs, fmt, k)), "served", job.adapter)

    if req.body.stream:  # the headers go first: the instance that took the stream
        events = sse(gateway, jobs, streams, fmt, req.body.stream_usage, req.http.scope)
        return ClosingStream(events, streams, settle,
                             headers=_route_headers(job, gateway.config, limits))
    try:
        result = await next_or_disconnect(req.http, collect(gateway, jobs, streams, fmt))
    finally:
        settle()
        await streams.aclose()  # normally closed by collect; not if it never started
    gateway.metrics.requests.labels(job.endpoint, "200", job.adapter or "base",
                                    job.instance_id or "none").inc()
    # After collect: a whole response retried elsewhere names the instance that served it.
    return JSONResponse(result, headers=_route_headers(job, gateway.config, limits))


async def _open_all(gateway: Gateway, jobs: list[Job], req: _Call) -> BatchStream:
    """Every job's stream, opened at once: each prompt's first sequence, then its others,
    which go where their first went (they share its cached blocks). Any failure (or the
    client leaving) cancels the opens under way, closes the streams opened (aborting their
    requests) and propagates."""
    k = req.body.samples_per_prompt
    opened: dict[int, ChunkStream] = {}

    async def open_one(i: int) -> None:
        job = jobs[i]
        job.whole = not req.body.stream
        job.prefer = jobs[i - i % k].instance_id if i % k else None
        opened[i] = await gateway.open(job)

    try:
        for wave in (range(0, len(jobs), k), [i for i in range(len(jobs)) if i % k]):
            tasks = [asyncio.ensure_future(open_one(i)) for i in wave]
            try:
                await next_or_disconnect(req.http, asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    except BaseException:
        await BatchStream(list(opened.values())).aclose()
        raise
    return BatchStream([opened[i] for i in range(len(jobs))])


def _used_tokens(jobs: list[Job], fmt: ResponseFormatter, k: int) -> tuple[int, int]:
    """(prompt, completion) tokens a served request is charged (TPM, usage): every prompt
    an engine took, whether or not a token came back (a client that leaves before its first
    token had its prefill run, or about to), and the tokens generated: what the formatter
    counted, or, for a whole response the client left before its end, every token held so
    far. ``k``: sequences per prompt (n, best_of)."""
    taken = {i // k for i, job in enumerate(jobs) if job.instance_id is not None}
    prompt = max(fmt.prompt_tokens,
                 sum(len(jobs[g * k].request.prompt_token_ids) for g in taken))
    return prompt, max(fmt.completion_tokens, sum(job.held_tokens for job in jobs))


def _route_headers(job: Job, config: GatewayConfig, limits: dict[str, str]
                   ) -> dict[str, str]:
    """The request id, the tenant's ``limits`` (OpenAI's x-ratelimit headers), the serving
    instance's opaque id (never its URL) and, with debug_headers only, the routing decision
    (engine URLs and every instance's score)."""
    headers = {"x-request-id": job.request_id, **limits}
    if job.decision is not None:
        headers["x-loragate-instance"] = instance_tag(job.decision.instance_id,
                                                      config.admin_key)
        if config.debug_headers:
            headers["x-loragate-route"] = job.decision.explain()
    return headers
