"""The Responses API's tools, structured outputs, logprobs and adapters through the live
gateway and engine, with the official `openai` client: forced calls come back as
function_call items (whole, and streamed through ``client.responses.stream``), a tool loop
sends them back with their outputs, text.format holds the output to its schema, include
gives chat's logprobs, and an adapter as ``model`` answers as it does on chat."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from tests.openai_api.helpers import MAX_TOKENS, MESSAGES, NO_EOS
from tests.openai_api.test_tools import TOOLS as CHAT_TOOLS

TOOLS: list[Any] = [{"type": "function", "strict": None, **tool["function"]}
                    for tool in CHAT_TOOLS]  # the Responses API's flat shape
ASK = "Turn on the kitchen light."


def _valid(name: str, arguments: str) -> bool:
    """Whether a call names one of TOOLS with arguments valid against its parameters."""
    schemas = {tool["name"]: tool["parameters"] for tool in TOOLS}
    if name not in schemas:
        return False
    jsonschema.validate(json.loads(arguments), schemas[name])
    return True


def test_a_required_call_is_a_function_call_item_and_a_tool_loop_runs(
        client: openai.OpenAI, base_model: str) -> None:
    reply = client.responses.create(model=base_model, input=ASK, tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=80, temperature=0)
    assert reply.status == "completed", reply
    (call,) = reply.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id is not None and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and _valid(call.name, call.arguments)
    assert reply.tools[0].type == "function" and reply.tool_choice == "required"
    # The client runs the function and sends the call (as returned) and its output back.
    loop: list[Any] = [{"role": "user", "content": ASK}, *reply.output,
                       {"type": "function_call_output", "call_id": call.call_id,
                        "output": "done"}]
    second = client.responses.create(model=base_model, input=loop, tools=TOOLS,
                                     max_output_tokens=8, temperature=0)
    # It is served as the chat request with the call and its result in the history.
    chat = client.chat.completions.create(
        model=base_model, tools=CHAT_TOOLS, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "done"}])
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == (chat.choices[0].message.content or "")


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_streams_as_function_call_events(client: openai.OpenAI,
                                                       base_model: str, choice: str) -> None:
    tool_choice: Any = {"type": "function", "name": "get_time"} if choice == "named" \
        else "required"
    request: dict[str, Any] = {"model": base_model, "input": ASK, "tools": TOOLS,
                               "tool_choice": tool_choice, "parallel_tool_calls": False,
                               "max_output_tokens": 60, "temperature": 0}
    whole = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    # The arguments as they are generated, one delta or more each (a token may add none).
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas > 2 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added = events[2]
    assert added.type == "response.output_item.added"
    assert added.item.status == "in_progress" and added.item.arguments == ""  # type: ignore[union-attr]
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    assert streamed == final.output[0].arguments  # type: ignore[union-attr]
    found = [[(c.name, c.arguments) for c in reply.output
              if isinstance(c, ResponseFunctionToolCall)] for reply in (whole, final)]
    assert len(whole.output) == len(final.output) == 1
    ((name, arguments),) = found[0]
    assert found == [[(name, arguments)]] * 2 and _valid(name, arguments)
    assert choice == "required" or name == "get_time"


def test_a_call_cut_at_max_output_tokens_is_an_incomplete_item(client: openai.OpenAI,
                                                               base_model: str) -> None:
    request: dict[str, Any] = {"model": base_model, "input": ASK, "tools": TOOLS,
                               "tool_choice": {"type": "function", "name": "get_time"},
                               "max_output_tokens": 3, "temperature": 0}
    whole = client.responses.create(**request)
    # The SDK's stream helper keeps a final response only from response.completed; the
    # response.incomplete event carries it here, as OpenAI sends it.
    *_, last = client.responses.create(**request, stream=True)
    assert last.type == "response.incomplete"
    final = last.response
    for reply in (whole, final):
        assert reply.status == "incomplete"
        (call,) = reply.output
        assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_time"
        assert call.status == "incomplete" and call.arguments.startswith("{")
    assert whole.output[0].arguments == final.output[0].arguments


def test_a_forced_call_takes_a_text_format_it_has_no_text_for(client: openai.OpenAI,
                                                               base_model: str) -> None:
    # As instructor's RESPONSES_TOOLS mode sends it, and OpenAI answers it: the call.
    reply = client.responses.create(
        model=base_model, input=ASK, tools=TOOLS, temperature=0, max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_time"},
        text={"format": {"type": "json_schema", "name": "User", "strict": True, "schema": {
            "type": "object", "properties": {"name": {"type": "string"}},
            "required": ["name"], "additionalProperties": False}}})
    (call,) = reply.output
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_time"
    assert _valid(call.name, call.arguments)
    assert reply.text and reply.text.format and reply.text.format.type == "json_schema"


def test_an_empty_tools_list_is_no_tools(client: openai.OpenAI, base_model: str) -> None:
    """As the openai-agents SDK sends it for an agent without tools."""
    request: dict[str, Any] = {"model": base_model, "input": ASK, "max_output_tokens": 4,
                               "temperature": 0}
    plain = client.responses.create(**request)
    empty = client.responses.create(**request, tools=[])
    assert empty.output_text == plain.output_text and empty.tools == []


def test_tool_choice_none_ignores_the_tools(client: openai.OpenAI, base_model: str) -> None:
    request: dict[str, Any] = {"model": base_model, "input": ASK, "max_output_tokens": 4,
                               "temperature": 0}
    plain = client.responses.create(**request)
    none = client.responses.create(**request, tools=TOOLS, tool_choice="none")
    assert none.output_text == plain.output_text and none.tool_choice == "none"


SCHEMA: dict[str, Any] = {"enum": ["red", "green", "blue"]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_json_schema_format_holds_the_output_to_it(client: openai.OpenAI, base_model: str,
                                                     stream: bool) -> None:
    text: Any = {"format": {"type": "json_schema", "name": "color", "schema": SCHEMA,
                            "strict": True}}
    request: dict[str, Any] = {"model": base_model, "input": MESSAGES, "text": text,
                               "max_output_tokens": 40, "temperature": 0.7,
                               "extra_body": {"seed": 7}}
    if stream:
        with client.responses.stream(**request) as events:
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            reply = events.get_final_response()
        assert "".join(deltas) == reply.output_text
    else:
        reply = client.responses.create(**request)
    assert reply.status == "completed" and json.loads(reply.output_text) in SCHEMA["enum"]
    assert reply.text is not None and reply.text.format is not None
    assert reply.text.format.type == "json_schema"


def test_json_object_format(client: openai.OpenAI, base_model: str) -> None:
    reply = client.responses.create(model=base_model, input=MESSAGES, max_output_tokens=20,
                                    text={"format": {"type": "json_object"}}, temperature=0)
    assert reply.output_text.lstrip().startswith("{")


def test_include_gives_the_chat_requests_logprobs(client: openai.OpenAI,
                                                  base_model: str) -> None:
    chat = client.chat.completions.create(model=base_model, messages=MESSAGES, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body=NO_EOS)
    request: dict[str, Any] = {"model": base_model, "input": MESSAGES, "temperature": 0,
                               "max_output_tokens": 4, "top_logprobs": 2,
                               "include": ["message.output_text.logprobs"],
                               "extra_body": NO_EOS}
    reply = client.responses.create(**request)
    assert chat.choices[0].logprobs is not None
    expected = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                for t in chat.choices[0].logprobs.content or []]
    message = reply.output[0]
    assert isinstance(message, ResponseOutputMessage)
    part = message.content[0]
    assert isinstance(part, ResponseOutputText) and part.logprobs is not None
    assert [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in part.logprobs] == expected
    assert len(expected) == 4 and reply.top_logprobs == 2
    streamed = [t for e in client.responses.create(**request, stream=True)
                if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, t.logprob) for t in streamed] == [(t, lp) for t, lp, _ in expected]


@pytest.mark.parametrize("model", ["a0", "a1"])
def test_an_adapter_as_model_answers_as_on_chat(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(model=model, messages=MESSAGES,
                                          max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=NO_EOS)
    reply = client.responses.create(model=model, input=MESSAGES, max_output_tokens=MAX_TOKENS,
                                    temperature=0, extra_body=NO_EOS)
    assert reply.model == model and reply.output_text == chat.choices[0].message.content


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{**TOOLS[0], "strict": True}], "tool_choice": "auto",  # calls or text
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"input": [{"type": "message", "role": "user", "content": ASK},  # answers no call
                {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}]},
     "input.[1].call_id"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.[0].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time", "foo": 1}},
     "tool_choice.foo"),
    ({"tools": [*TOOLS, {"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     f"tools.[{len(TOOLS)}].parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "no-such-type"}}}}, "text"),
])
def test_bad_tool_and_format_requests_are_400s(client: openai.OpenAI, base_model: str,
                                               body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=base_model, input=ASK, max_output_tokens=4,
                                extra_body=body)
    assert refused.value.param == param, refused.value.body
