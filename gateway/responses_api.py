"""OpenAI's Responses API, stateless, as vLLM and SGLang serve it: ``POST /v1/responses``.

The request is translated into a chat completions request (gateway/responses_protocol.py)
and served by the chat route itself, so everything that route does holds here unchanged:
its bounds, prompt encoding and chat template, admission and the tenant's token
reservation, routing, adapters as ``model``, tools, structured outputs, usage accounting,
metrics, the access log, and a hang-up that aborts the engine request. Its answer is
translated back: a chat completion into a response object (gateway/responses_format.py),
a chat stream into the Responses API's named events (gateway/responses_stream.py). An
error before the first byte is the chat route's, naming the field as this API names it
(``input``, not ``messages``).

Nothing is stored (``store`` is always false), so ``GET``/``DELETE /v1/responses/{id}``,
its ``input_items`` and ``cancel`` answer 404.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import NoReturn

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.http.errors import ApiError
from engine.protocol import EngineError
from gateway.admission import Admitted, AdmittedRoute
from gateway.auth import Principal
from gateway.caller import Caller
from gateway.job import Claim
from gateway.openai_chat_protocol import ChatCompletionRequest
from gateway.responses_format import ResponseEcho, from_chat_completion
from gateway.responses_protocol import ResponsesRequest, as_named_here
from gateway.responses_stream import ResponseEvents, response_events
from gateway.shutdown_cutoff import CUT_TAIL_KEY

RESPONSES_PATH = "/v1/responses"
ChatRoute = Callable[[ChatCompletionRequest, Request, Principal, Claim], Awaitable[Response]]
"""The chat completions route's handler (gateway/openai_api.py)."""

NOT_STORED = ("/v1/responses/{response_id}", ["GET", "DELETE"]), \
    ("/v1/responses/{response_id}/input_items", ["GET"]), \
    ("/v1/responses/{response_id}/cancel", ["POST"])


def build_responses_router(chat: ChatRoute) -> APIRouter:
    """The Responses routes over the chat route ``chat``."""
    router = APIRouter()
    admitted = APIRouter(route_class=AdmittedRoute)  # admitted before the body, as chat

    @admitted.post(RESPONSES_PATH)
    async def create_response(body: ResponsesRequest, request: Request, principal: Caller,
                              claim: Admitted) -> Response:
        chat_body = body.chat_request()
        try:
            answer = await chat(chat_body, request, principal, claim)
        except (ApiError, EngineError) as exc:
            _rename_param(exc)
            raise
        # After the chat route named the model; the sampling it ran with where none was set.
        echo = ResponseEcho.of(body, chat_body,
                               request.app.state.gateway.sampling_defaults())
        if isinstance(answer, StreamingResponse):
            # The same response (its headers, and the closing that aborts the engine
            # request on a hang-up), with the chat events translated as they pass.
            events = ResponseEvents(echo)
            answer.body_iterator = response_events(answer.body_iterator, events)
            request.scope[CUT_TAIL_KEY] = events.cut_tail  # a shutdown's cut, as its events
            return answer
        completion = json.loads(bytes(answer.body))
        return JSONResponse(from_chat_completion(echo, completion), headers={
            name: value for name, value in answer.headers.items() if name.startswith("x-")})

    async def not_stored(response_id: str, principal: Caller) -> NoReturn:
        shown = response_id if len(response_id) <= 64 else response_id[:61] + "..."
        raise ApiError(404, f"Response with id {shown!r} not found: this server stores no "
                       "responses (store is always false)", code="response_not_found",
                       param="response_id")

    for path, methods in NOT_STORED:
        router.add_api_route(path, not_stored, methods=methods, response_model=None,
                             include_in_schema=False)
    router.include_router(admitted)
    return router


def _rename_param(exc: ApiError | EngineError) -> None:
    """An error about a field the translation renamed names it as the client sent it."""
    if exc.param:
        exc.param, exc.message = as_named_here(exc.param, exc.message)
