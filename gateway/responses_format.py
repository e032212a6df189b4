"""Responses API objects built from the chat path's results: the response object (of a whole
chat completion here, of a chat stream's events in gateway/responses_stream.py), its output
items and its usage.

A chat answer becomes at most one ``message`` item (its content, with the logprobs of the
tokens when asked), then one ``function_call`` item per tool call, in the order OpenAI
gives them. An answer with neither content nor calls is an empty message, so
``output_text`` is always there. A chat ``finish_reason`` of ``length`` is an incomplete
response (``incomplete_details.reason: "max_output_tokens"``), as OpenAI ends one at
max_output_tokens.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.generation_defaults import SamplingDefaults
from gateway.openai_chat_protocol import ChatCompletionRequest
from gateway.responses_protocol import ResponsesRequest
from gateway.tool_calls import is_json

Status = Literal["in_progress", "completed", "incomplete", "failed"]
INCOMPLETE = {"reason": "max_output_tokens"}
"""incomplete_details of a response cut at its token budget."""


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: resp_..., msg_..., fc_..., call_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseEcho:
    """The parts of every response object of one request that do not change as it runs: its
    id, and the request's settings, which OpenAI's response object repeats (``store`` is
    always false: nothing is kept)."""

    id: str
    created_at: int
    settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, body: ResponsesRequest, chat: ChatCompletionRequest,
           defaults: SamplingDefaults) -> ResponseEcho:
        """``chat``: the request that served ``body``, after the chat path named its model;
        ``defaults``: the sampling it had where it set none (the temperature and top_p
        echoed are those it ran with, as OpenAI's are)."""
        used = defaults.sampling_params()
        text = body.text.format if body.text is not None else None
        choice = body.tool_choice
        return cls(new_id("resp"), int(time.time()), {
            "background": False,
            "instructions": body.instructions,
            "max_output_tokens": chat.max_completion_tokens,
            "max_tool_calls": None,
            "model": chat.model,
            "parallel_tool_calls": chat.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "default",
            "store": False,
            "temperature": used.temperature if chat.temperature is None else chat.temperature,
            "text": {"format": {"type": "text"} if text is None else
                     text.model_dump(by_alias=True, exclude_none=True),
                     "verbosity": "medium"},
            "tool_choice": "auto" if choice is None else
            choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [tool.model_dump() for tool in body.tools or []],
            "top_logprobs": chat.top_logprobs or 0,
            "top_p": used.top_p if chat.top_p is None else chat.top_p,
            "truncation": "disabled",
            "user": chat.user,
            "safety_identifier": chat.safety_identifier,
            "metadata": dict(body.metadata or {}),
        })

    def response(self, status: Status, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object as it stands: ``usage`` once it ended, ``error`` if it
        failed."""
        ended = status in ("completed", "incomplete")
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error,
                "incomplete_details": INCOMPLETE if status == "incomplete" else None,
                "output": output, "usage": usage,
                "completed_at": int(time.time()) if ended else None, **self.settings}


def output_text(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    """A message's output_text part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, status: Status, content: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: Status) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """A chat usage object in the Responses API's names. Prompt-cache writes are not counted
    (0); there are no reasoning tokens."""
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def ended_status(finish_reason: str | None) -> Status:
    return "incomplete" if finish_reason == "length" else "completed"


def call_status(arguments: str) -> Status:
    """A call whose arguments are whole JSON is completed; one cut at max_output_tokens
    (its arguments so far) is incomplete."""
    return "completed" if is_json(arguments) else "incomplete"


def from_chat_completion(echo: ResponseEcho, completion: dict[str, Any]) -> dict[str, Any]:
    """The response object of a whole chat completion (one choice)."""
    choice = completion["choices"][0]
    message = choice["message"]
    status = ended_status(choice["finish_reason"])
    calls = message.get("tool_calls") or []
    output = []
    if message.get("content") is not None or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output.append(message_item(new_id("msg"), status, [
            output_text(message.get("content") or "", logprobs)]))
    output += [function_call_item(new_id("fc"), new_id("call"), call["function"]["name"],
                                  call["function"]["arguments"],
                                  call_status(call["function"]["arguments"]))
               for call in calls]
    return echo.response(status, output, usage(completion["usage"]))
