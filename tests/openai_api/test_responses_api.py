"""The Responses API (POST /v1/responses, stateless) through the live gateway and engine:
the same tokens, usage and limits as the chat request it is served as, response objects and
stream events the official `openai` client parses (checked against its types too), refused
fields named, and a hang-up that frees the engine. Tools, structured outputs, logprobs and
adapters: test_responses_tools.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from transformers import PreTrainedTokenizerBase

from tests.live_http import metric
from tests.live_servers import LiveServer
from tests.openai_api.helpers import (
    CONTEXT,
    MAX_TOKENS,
    MESSAGES,
    NO_EOS,
    chat_prompt_tokens,
    wait_engine_idle,
)

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
SAME_AS_MESSAGES: dict[str, Any] = {  # each asks what MESSAGES asks
    "instructions": {"instructions": "Be brief.", "input": "hello world"},
    "messages": {"input": MESSAGES},
    "typed items": {"input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "hello world"}]}]},
    "instructions and a list": {"instructions": "Be brief.",
                                "input": [{"role": "user", "content": "hello world"}]},
}


def _post(gateway: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/responses", json=body, timeout=30.0)


def _events(text: str) -> list[dict[str, Any]]:
    """A raw Responses stream's events, each checked to be a named SSE event of its type."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        EVENT.validate_python(event)  # strictly, against the SDK's types
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


@pytest.mark.parametrize("form", SAME_AS_MESSAGES.values(), ids=SAME_AS_MESSAGES.keys())
def test_input_forms_give_the_chat_requests_tokens_and_usage(
        client: openai.OpenAI, base_model: str, tokenizer: PreTrainedTokenizerBase,
        form: dict[str, Any]) -> None:
    chat = client.chat.completions.create(model=base_model, messages=MESSAGES,
                                          max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=NO_EOS)
    reply = client.responses.create(model=base_model, max_output_tokens=MAX_TOKENS,
                                    temperature=0, extra_body=NO_EOS, **form)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.status == "incomplete" and reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None and chat.usage is not None
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (
        chat.usage.prompt_tokens, MAX_TOKENS, chat.usage.total_tokens)
    assert reply.usage.input_tokens == chat_prompt_tokens(tokenizer, MESSAGES)


def test_the_response_object_has_openais_shape(gateway: LiveServer, base_model: str) -> None:
    counted = metric(httpx.get(gateway.url + "/metrics", timeout=30.0).text,
                     "loragate_gateway_requests_total", endpoint="responses", status="200")
    answer = _post(gateway, {"model": base_model, "input": "hello world", "store": False,
                             "max_output_tokens": 4, "temperature": 0, "ignore_eos": True,
                             "metadata": {"run": "7"}, "user": "u1", "truncation": "disabled"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] and answer.headers["x-loragate-instance"]
    body = answer.json()
    Response.model_validate(body)  # every required field, strictly typed
    assert body["id"].startswith("resp_") and body["object"] == "response"
    (item,) = body["output"]
    assert item["id"].startswith("msg_") and item["status"] == "incomplete"
    assert (item["type"], item["role"]) == ("message", "assistant")
    (part,) = item["content"]
    assert (part["type"], part["annotations"], part["logprobs"]) == ("output_text", [], [])
    assert body["usage"]["output_tokens"] == 4 and body["usage"]["total_tokens"] == \
        body["usage"]["input_tokens"] + 4
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    assert {key: body[key] for key in (
        "status", "incomplete_details", "error", "model", "instructions", "max_output_tokens",
        "metadata", "parallel_tool_calls", "temperature", "top_p", "text", "tool_choice",
        "tools", "truncation", "store", "previous_response_id", "user")} == {
        "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
        "error": None, "model": base_model, "instructions": None, "max_output_tokens": 4,
        "metadata": {"run": "7"}, "parallel_tool_calls": True, "temperature": 0.0,
        "top_p": 1.0, "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": "auto", "tools": [], "truncation": "disabled", "store": False,
        "previous_response_id": None, "user": "u1"}
    # Counted as a Responses request, not as the chat request that served it.
    assert metric(httpx.get(gateway.url + "/metrics", timeout=30.0).text,
                  "loragate_gateway_requests_total", endpoint="responses",
                  status="200") == counted + 1


def test_a_stream_joins_to_the_whole_response(client: openai.OpenAI, gateway: LiveServer,
                                              base_model: str) -> None:
    request: dict[str, Any] = {"model": base_model, "input": "hello world",
                               "instructions": "Be brief.", "max_output_tokens": MAX_TOKENS,
                               "temperature": 0}
    whole = client.responses.create(**request, extra_body=NO_EOS)
    events = list(client.responses.create(**request, stream=True, extra_body=NO_EOS))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(
                         deltas), "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0], events[-1]
    assert created.type == "response.created" and final.type == "response.incomplete"
    assert created.response.status == "in_progress" and created.response.id == final.response.id
    assert "".join(d.delta for d in deltas) == final.response.output_text == whole.output_text
    assert final.response.usage == whole.usage
    item_ids = {getattr(e, "item_id", None) for e in events} - {None}
    assert item_ids == {final.response.output[0].id}
    # On the wire: named events, none of them [DONE].
    raw = _post(gateway, {**request, **NO_EOS, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in raw.text
    assert [e["type"] for e in _events(raw.text)] == kinds


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_errors_before_the_first_byte_are_chats_named_as_this_api_names_them(
        client: openai.OpenAI, gateway: LiveServer, base_model: str, stream: bool) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="nope", input="hi", stream=stream)
    assert missing.value.code == "model_not_found"
    too_long = _post(gateway, {"model": base_model, "input": "a " * CONTEXT, "stream": stream})
    assert too_long.status_code == 400
    assert (too_long.json()["error"]["param"], too_long.json()["error"]["code"]) == (
        "input", "context_length_exceeded")
    too_many = _post(gateway, {"model": base_model, "input": "hi", "stream": stream,
                               "max_output_tokens": CONTEXT + 1})
    error = too_many.json()["error"]
    assert too_many.status_code == 400 and error["param"] == "max_output_tokens"
    assert error["message"].startswith(f"max_output_tokens ({CONTEXT + 1})")
    # A bound chat checks, in this API's words (the system message of instructions counts).
    crowded = _post(gateway, {"model": base_model, "instructions": "x", "stream": stream,
                              "input": [{"role": "user", "content": "hi"}] * 4096})
    assert crowded.status_code == 400 and crowded.json()["error"]["param"] == "input"
    assert crowded.json()["error"]["message"] == "input holds 4097 messages, more than 4096"


@pytest.mark.parametrize(("changes", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": []}, "input"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without include
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),  # without stream
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema"}}}, "text"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"n": 2}, "n"),
    ({"messages": MESSAGES}, "messages"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_refused_fields_are_400s_naming_them(gateway: LiveServer, base_model: str,
                                             changes: dict[str, Any], param: str) -> None:
    answer = _post(gateway, {"model": base_model, "input": "hi", "max_output_tokens": 4,
                             **changes})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_a_refusal_says_what_the_chat_route_would(gateway: LiveServer, base_model: str
                                                 ) -> None:
    """Said as chat says it (not pydantic's words for the first member of a union)."""
    for changes, says in (({"stop": ["a"] * 100}, "at most 16 items"),
                          ({"seed": 2**64}, str(2**64))):
        answer = _post(gateway, {"model": base_model, "input": "hi", **changes})
        assert answer.status_code == 400 and says in answer.json()["error"]["message"], \
            answer.text
    # A renamed field in this API's name, in the message as in param.
    crowded = _post(gateway, {"model": base_model, "input": "hi",
                              "max_output_tokens": CONTEXT + 1})
    error = crowded.json()["error"]
    assert (crowded.status_code, error["param"]) == (400, "max_output_tokens"), crowded.text
    assert error["message"].startswith(f"max_output_tokens ({CONTEXT + 1}) is more than")
    assert "max_completion_tokens" not in error["message"]


def test_nothing_is_stored(gateway: LiveServer) -> None:
    for method, path in [("GET", "resp_123"), ("DELETE", "resp_123"),
                         ("GET", "resp_123/input_items"), ("POST", "resp_123/cancel")]:
        answer = httpx.request(method, gateway.url + "/v1/responses/" + path, timeout=30.0)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "response_not_found"
        assert "stores no responses" in answer.json()["error"]["message"]


def test_an_engine_failure_mid_stream_is_an_error_then_response_failed(
        gateway: LiveServer, base_model: str, tokenizer: PreTrainedTokenizerBase) -> None:
    # Only the end-of-sequence token is allowed and min_tokens bans it: the engine fails the
    # request at its first token (test_errors.py), after the stream began.
    body = {"model": base_model, "input": "hi", "max_output_tokens": 4,
            "allowed_token_ids": [tokenizer.eos_token_id], "min_tokens": 2}
    whole = _post(gateway, body)
    assert whole.status_code == 400 and whole.json()["error"]["code"] == "invalid_request"
    events = _events(_post(gateway, {**body, "stream": True}).text)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "error", "response.failed"]
    assert events[2]["code"] == "invalid_request"
    failed = events[3]["response"]
    assert failed["status"] == "failed" and failed["id"] == events[0]["response"]["id"]
    assert "no token is allowed" in failed["error"]["message"]


def test_a_hang_up_mid_stream_frees_the_engine(gateway: LiveServer, engine: LiveServer,
                                               base_model: str) -> None:
    body = {"model": base_model, "input": "hello", "max_output_tokens": 900, "stream": True,
            **NO_EOS}
    with httpx.stream("POST", gateway.url + "/v1/responses", json=body, timeout=30.0) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if "output_text.delta" in line)
        running = httpx.get(engine.url + "/state").json()
        assert running["num_running"] == 1 and running["kv_blocks_used"] > 0
    wait_engine_idle(engine.url)
