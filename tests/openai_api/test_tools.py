"""Tool calling through the live gateway and engine with the official `openai` client: a
forced call (tool_choice required or named) always comes back as tool_calls whose arguments
validate, streamed or not; a conversation with calls and tool results in its history is
served; and wrong tool requests are 400s. (The tiny model's template takes no tools: they
reach it in a system message.)"""

from __future__ import annotations

import enum
import json
from typing import Any

import httpx
import openai
import pydantic
import pytest
from transformers import PreTrainedTokenizerBase

from tests.live_servers import LiveServer

TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": "set_light", "description": "Switch a light",
        "parameters": {"type": "object", "properties": {
            "room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
            "required": ["room", "on"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
            "additionalProperties": False}}},
]
ASK: list[Any] = [{"role": "user", "content": "Turn on the kitchen light."}]


def _valid(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "set_light":
        return set(args) == {"room", "on"} and args["room"] in ("kitchen", "hall") \
            and isinstance(args["on"], bool)
    return name == "get_time" and args == {"zone": args["zone"]} and \
        args["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_calls_a_tool(client: openai.OpenAI, base_model: str,
                                      parallel: bool) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model=base_model, messages=ASK, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=parallel, max_tokens=120, temperature=0.9, seed=seed)
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        if choice.finish_reason == "length":  # cut short: still calls, never the array
            assert choice.message.content is None
        else:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            assert call.function.name in {t["function"]["name"] for t in TOOLS}
            # Cut before any call completed: the one cut short, its arguments so far.
            if choice.finish_reason != "length" or len(calls) > 1:
                assert _valid(call.function.name, call.function.arguments)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_a_forced_call_takes_a_response_format_it_has_no_text_for(
        client: openai.OpenAI, base_model: str, choice: Any) -> None:
    # OpenAI takes the pair (instructor's Responses modes send it): response_format shapes
    # a message's text, and a forced answer is its calls.
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "t", "strict": True, "schema": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
        "additionalProperties": False}}}
    reply = client.chat.completions.create(
        model=base_model, messages=ASK, tools=TOOLS, tool_choice=choice, response_format=fmt,
        parallel_tool_calls=False, max_tokens=60, temperature=0)
    [call] = reply.choices[0].message.tool_calls or []
    assert call.type == "function" and reply.choices[0].message.content is None
    assert reply.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert _valid(call.function.name, call.function.arguments)


class Room(enum.StrEnum):
    kitchen = "kitchen"
    hall = "hall"


class Lamp(pydantic.BaseModel):
    room: Room


class SetLamp(pydantic.BaseModel):
    """A pydantic model's schema: $defs and "#/$defs/..." refs."""

    lamp: Lamp
    on: bool


def test_required_takes_pydantic_tools_with_refs(client: openai.OpenAI,
                                                 base_model: str) -> None:
    # Bounded arguments (enums, a bool) and one call: the grammar ends the array.
    reply = client.chat.completions.create(
        model=base_model, messages=ASK, tools=[openai.pydantic_function_tool(SetLamp)],
        tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "SetLamp"  # type: ignore[union-attr]
    SetLamp.model_validate_json(call.function.arguments)  # type: ignore[union-attr]


def test_a_named_choice_calls_that_tool_streamed_or_not(client: openai.OpenAI,
                                                        base_model: str) -> None:
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    args: dict[str, Any] = {"model": base_model, "messages": ASK, "tools": TOOLS,
                            "tool_choice": named, "max_tokens": 60, "temperature": 0}
    reply = client.chat.completions.create(**args)
    [call] = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_time" and _valid("get_time", call.function.arguments)
    assert reply.choices[0].finish_reason == "stop"  # OpenAI's (and vLLM's) for a named call
    deltas = [e.choices[0] for e in client.chat.completions.create(**args, stream=True)
              if e.choices]
    streamed = [c for d in deltas for c in d.delta.tool_calls or []]
    # The arguments come as they are generated (as OpenAI and vLLM stream them): the first
    # delta opens the call with its id and name, the later ones add to its arguments.
    assert len(streamed) > 2 and all(c.index == 0 and c.function for c in streamed)
    assert streamed[0].id and streamed[0].function.name == "get_time"
    assert all(c.id is None and c.function.name is None for c in streamed[1:])
    assert "".join(c.function.arguments or "" for c in streamed) == call.function.arguments
    assert deltas[-1].finish_reason == "stop"
    assert all(not d.delta.content for d in deltas)
    # The finish in a chunk of its own (as OpenAI ends a choice: the openai SDK closes a
    # call's arguments when a later chunk comes).
    assert deltas[0].delta.role == "assistant"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].delta.tool_calls is None and deltas[-1].delta.content is None
    raw = httpx.post(str(client.base_url) + "chat/completions", timeout=60.0,
                     json={**args, "stream": True}).text.splitlines()
    last = json.loads([line for line in raw if line.startswith("data: {")][-1][6:])
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    with client.chat.completions.stream(**args) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [("get_time", call.function.arguments)]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_stream_their_arguments_as_generated(client: openai.OpenAI,
                                                            base_model: str,
                                                            parallel: bool) -> None:
    # Each call opens (id and name) once its arguments begin, and they follow as they are
    # generated (as vLLM streams them); joined, they are the whole response's calls.
    args: dict[str, Any] = {"model": base_model, "messages": ASK, "tools": TOOLS,
                            "tool_choice": "required", "parallel_tool_calls": parallel,
                            "max_tokens": 60, "temperature": 0}
    reply = client.chat.completions.create(**args)
    whole = [(c.function.name, c.function.arguments)
             for c in reply.choices[0].message.tool_calls or []]
    assert whole
    deltas = [e.choices[0] for e in client.chat.completions.create(**args, stream=True)
              if e.choices]
    calls: dict[int, list[str]] = {}
    pieces = 0
    for delta in deltas:
        assert not delta.delta.content
        for call in delta.delta.tool_calls or []:
            assert call.function is not None
            if call.id is not None:
                assert call.index not in calls and call.function.name
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                assert call.function.name is None
                calls[call.index][1] += call.function.arguments or ""
            pieces += 1
    assert [tuple(calls[i]) for i in sorted(calls)] == whole
    assert pieces > 2 * len(whole)  # not whole calls at the end
    assert deltas[-1].finish_reason == reply.choices[0].finish_reason
    assert reply.choices[0].finish_reason in (("length", "tool_calls") if parallel
                                              else ("tool_calls",))
    if not parallel:  # the SDK's stream helper closes the call with its whole arguments
        with client.chat.completions.stream(**args) as stream:
            done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        assert [(e.name, e.arguments) for e in done] == whole


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_cut_at_max_tokens_is_still_a_call(
        client: openai.OpenAI, base_model: str, tokenizer: PreTrainedTokenizerBase,
        choice: str) -> None:
    """As OpenAI answers it: the call with its arguments so far, never the constrained text
    as content, streamed or not."""
    tool_choice: Any = {"type": "function", "function": {"name": "get_time"}} \
        if choice == "named" else "required"
    args: dict[str, Any] = {"model": base_model, "messages": ASK, "tools": TOOLS,
                            "tool_choice": tool_choice, "temperature": 0}
    # The cut: inside a named call's arguments; for required, one token after the first
    # call's name and '"arguments": ' (greedy: the uncut answer's tokens tell where).
    cut = 3
    if choice == "required":
        whole = client.chat.completions.create(**args, max_tokens=120,
                                               extra_body={"return_token_ids": True})
        ids = whole.choices[0].model_extra["token_ids"]
        cut = next(k for k in range(1, len(ids)) if '"arguments":' in
                   tokenizer.decode(ids[:k - 1])) + 1
    args["max_tokens"] = cut
    reply = client.chat.completions.create(**args)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length" and message.content is None
    [call] = message.tool_calls or []
    assert call.function.name in {t["function"]["name"] for t in TOOLS}
    if choice == "named":
        assert call.function.name == "get_time"
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        assert call.function.arguments.startswith("{")
    deltas = [e.choices[0] for e in client.chat.completions.create(**args, stream=True)
              if e.choices]
    streamed = [c.function for d in deltas for c in d.delta.tool_calls or [] if c.function]
    assert streamed[0].name == call.function.name
    assert "".join(f.arguments or "" for f in streamed) == call.function.arguments
    assert deltas[-1].finish_reason == "length"
    assert all(not d.delta.content for d in deltas)


def test_a_history_with_calls_and_results_is_served(client: openai.OpenAI,
                                                    base_model: str, gateway: LiveServer
                                                    ) -> None:
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "set_light", "arguments": '{"room": "kitchen", "on": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    reply = client.chat.completions.create(model=base_model, messages=history, tools=TOOLS,
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The call is in the prompt, as the model would have written it; /tokenize agrees.
    ids = httpx.post(gateway.url + "/tokenize", timeout=30.0, json={
        "model": base_model, "messages": history, "tools": TOOLS}).json()["tokens"]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    text = httpx.post(gateway.url + "/detokenize", timeout=30.0, json={
        "model": base_model, "tokens": ids}).json()["prompt"]
    assert '<tool_call>{"name": "set_light", "arguments": {"room": "kitchen", "on": true}}' \
           in text and '"name": "get_time"' in text


def test_tool_choice_none_or_an_empty_tools_list_is_a_plain_answer(client: openai.OpenAI,
                                                                     base_model: str) -> None:
    """Each asks for what happens anyway (vLLM takes both; langchain's bind_tools([]) and
    litellm send tools: [])."""
    request: dict[str, Any] = {"model": base_model, "messages": ASK, "max_tokens": 4,
                               "temperature": 0}
    plain = client.chat.completions.create(**request)
    none = client.chat.completions.create(**request, tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    empty = client.chat.completions.create(**request, tools=[])
    assert empty.choices[0].message.content == plain.choices[0].message.content
    assert empty.usage and plain.usage  # the template saw no tools either:
    assert empty.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize("body", [
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tool_choice": "required"},
    {"tool_choice": "auto"},                                     # a choice among no tools
    {"tools": [], "tool_choice": "required"},                    # a choice among no tools
    {"tools": TOOLS, "tool_choice": "required", "guided_json": {"type": "object"}},
    {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"},
     "guided_regex": "[a-z]+"},
    {"tools": TOOLS + TOOLS[:1]},                                # a name twice
    {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
    {"functions": [{"name": "f"}]},                              # the legacy API
])
def test_bad_tool_requests_are_400(gateway: LiveServer, base_model: str,
                                   body: dict[str, Any]) -> None:
    answer = httpx.post(gateway.url + "/v1/chat/completions", timeout=30.0, json={
        "model": base_model, "messages": ASK, "max_tokens": 4, **body})
    assert answer.status_code == 400, answer.text
