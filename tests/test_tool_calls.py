"""Tool calls parsed out of model text (the Hermes `<tool_call>` format and bare JSON calls),
what may be streamed before the end, the constraints of forced calls, and the tools reaching
a chat template that takes them with control-token text kept plain."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.http.errors import ApiError
from gateway.openai_chat_protocol import ChatCompletionRequest
from gateway.prompts import PromptEncoder
from gateway.tool_calls import Function, ToolPlan, template_takes_tools

WEATHER = Function("get_weather", "The weather in a city",
                   {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]})
ADD = Function("add", None, {"type": "object", "properties": {"a": {"type": "integer"},
                                                              "b": {"type": "integer"}}})
AUTO = ToolPlan((WEATHER, ADD), "auto")


def _calls(found: list[dict[str, object]]) -> list[tuple[object, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))  # type: ignore[index]
            for c in found]


def test_hermes_blocks_and_the_content_around_them() -> None:
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
            '</tool_call>')
    content, found = AUTO.parse(text)
    assert content == "Let me check. "  # as it came before the first call (vLLM's)
    assert _calls(found) == [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
               for c in found)
    # Calls not parallel: the first one only (as vLLM), the content the same.
    single = ToolPlan((WEATHER, ADD), "auto", parallel=False)
    content, found = single.parse(text)
    assert content == "Let me check. "
    assert _calls(found) == [("get_weather", {"city": "Oslo"})]
    bare = '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]'
    assert _calls(single.parse(bare)[1]) == [("add", {"a": 1})]
    assert len(AUTO.parse(bare)[1]) == 2


@pytest.mark.parametrize("text, calls", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', [("add", {"a": 1, "b": 2})]),
    ('[{"name": "add", "parameters": {"a": 3}}]', [("add", {"a": 3})]),  # llama-3 spelling
    ('{"name": "delete_everything", "arguments": {}}', []),              # not offered
    ('{"a": 1}', []),                                                    # JSON, not a call
    ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', []),  # broken JSON
    ("The answer is 3.", []),
])
def test_what_is_and_is_not_a_call(text: str, calls: list[tuple[str, object]]) -> None:
    content, found = AUTO.parse(text)
    assert _calls(found) == calls
    assert content == (None if calls else text)


def test_forced_calls_parse_their_constrained_output() -> None:
    required = ToolPlan((WEATHER, ADD), "required", parallel=False)
    constraint = required.constraint()
    assert constraint is not None and constraint.kind == "json"
    assert json.loads(constraint.spec)["maxItems"] == 1
    _, found = required.parse('[{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    assert _calls(found) == [("add", {"a": 1, "b": 2})]
    named = ToolPlan((WEATHER, ADD), "named", "get_weather")
    assert named.constraint() is not None
    assert json.loads(named.constraint().spec) == WEATHER.parameters  # type: ignore[union-attr]
    assert _calls(named.parse('{"city": "Rome"}')[1]) == [("get_weather", {"city": "Rome"})]
    assert ToolPlan((WEATHER,), "none").parse("hi") == ("hi", [])


def test_a_required_call_keeps_each_functions_refs_pointing_into_its_own_schema() -> None:
    """A pydantic model's parameters ($defs, "#/$defs/..."), a recursive one ("#") and a
    property named like a keyword, forced together: the grammar compiles, and it takes
    exactly the calls valid against each function."""
    person = Function("save_person", None, {
        "$defs": {"Color": {"enum": ["red", "blue"], "type": "string"},
                  "Address": {"properties": {"city": {"type": "string"}},
                              "required": ["city"], "type": "object"}},
        "properties": {"favorite": {"$ref": "#/$defs/Color"},
                       "address": {"$ref": "#/$defs/Address"},
                       "enum": {"const": {"$ref": "#/not-a-ref"}}},
        "required": ["favorite", "address"], "type": "object"})
    tree = Function("tree", None, {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["kids"], "additionalProperties": False})
    spec = json.loads(ToolPlan((person, tree), "required").constraint().spec)  # type: ignore[union-attr]
    assert spec["$defs"]["tool0"]["properties"]["favorite"] == {
        "$ref": "#/$defs/tool0/$defs/Color"}
    assert spec["$defs"]["tool0"]["properties"]["enum"] == {"const": {"$ref": "#/not-a-ref"}}
    assert spec["$defs"]["tool1"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/tool1"}
    xgrammar = pytest.importorskip("xgrammar")
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(["a"]), max_threads=1,
                                        cache_enabled=False)
    compiled = compiler.compile_json_schema(json.dumps(spec), any_whitespace=False)

    def accepts(calls: list[dict[str, Any]]) -> bool:
        """Whether the grammar takes exactly these calls, written as it writes JSON."""
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return bool(matcher.accept_string(json.dumps(calls))) and matcher.is_terminated()

    address = {"city": "Paris"}
    assert accepts([{"name": "save_person", "arguments": {"favorite": "blue",
                                                          "address": address}}])
    assert accepts([{"name": "tree", "arguments": {"kids": [{"kids": []}]}}])
    assert not accepts([{"name": "save_person", "arguments": {"favorite": "green",
                                                              "address": address}}])
    assert not accepts([{"name": "tree", "arguments": {"kids": [{"kids": [], "x": 1}]}}])


@pytest.mark.parametrize("comma", [",", ", ", " ,\n  "])  # ", ": the grammar's separator
def test_a_forced_call_cut_short_stays_a_call(comma: str) -> None:
    required = ToolPlan((WEATHER, ADD), "required")
    whole = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    cut = f'[{whole}{comma}{whole.replace("1", "5")}{comma}{{"name": "get_weather", "argu'
    content, found = required.parse_cut(cut)
    assert content is None
    assert _calls(found) == [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 2})]
    # The call it cut once its arguments began, with its arguments so far (as its stream
    # sent them); never the grammar's array as content.
    content, found = required.parse_cut(cut + 'ments": {"city": "Os')
    assert [c["function"]["arguments"] for c in found] == [
        '{"a": 1, "b": 2}', '{"a": 5, "b": 2}', '{"city": "Os']
    content, found = required.parse_cut('[{"name": "get_weather", "arguments": {"ci')
    assert content is None and [(c["function"]["name"], c["function"]["arguments"])
                                for c in found] == [("get_weather", '{"ci')]
    for nothing in ('[{"name":"add","argum', '[{"name": "unknown", "arguments": {',
                    '[{"na', "[", ""):
        assert required.parse_cut(nothing) == (None, [])
    named = ToolPlan((WEATHER, ADD), "named", "get_weather")
    # A stop string's cut ends it as max_tokens' does: the call, as its stream sent it.
    content, found = named.parse('{"city": "Ro')
    assert content is None and [(c["function"]["name"], c["function"]["arguments"])
                                for c in found] == [("get_weather", '{"city": "Ro')]
    content, found = named.parse_cut('{"city": "Ro')
    assert content is None and [(c["function"]["name"], c["function"]["arguments"])
                                for c in found] == [("get_weather", '{"city": "Ro')]
    assert ToolPlan((WEATHER, ADD), "auto").parse_cut('{"city": "Ro') == ('{"city": "Ro', [])


def test_an_auto_block_closed_before_the_cut_is_a_call() -> None:
    # The model closed a call, then ran on until max_tokens: the call is returned as when a
    # stop string ends the same text (vLLM's hermes parser reads it so too); a block the cut
    # left open stays text.
    auto = ToolPlan((WEATHER, ADD), "auto")
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = f"Let me check. {block}\nThe weather in Paris is usually"
    content, found = auto.parse_cut(text)
    assert _calls(found) == [("get_weather", {"city": "Paris"})]
    assert content == "Let me check. \nThe weather in Paris is usually"
    opened = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1'
    assert auto.parse_cut(opened) == (opened, [])


@pytest.mark.parametrize("text, sendable", [
    ("Hello there", "Hello there"),
    ("Hello <tool", "Hello "),                 # may become a tag: held back
    ("Hi <tool_call>{...", "Hi "),
    ('  {"name": ', ""),                       # may be a bare JSON call
    ("   ", ""),
])
def test_auto_streams_only_what_cannot_become_a_call(text: str, sendable: str) -> None:
    assert text[:AUTO.streamable_prefix(text)] == sendable
    assert ToolPlan((ADD,), "required").streamable_prefix(text) == 0


def test_tools_reach_a_template_that_takes_them(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert not template_takes_tools(tokenizer.chat_template)  # the fallback's case, below
    tokenizer.chat_template = (
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
        "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}"
        "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    encoder = PromptEncoder(tokenizer)
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "tools": [{"type": "function", "function": {
            "name": "add", "description": "adds <|im_end|> numbers",
            "parameters": {"type": "object"}}}],
        "messages": [{"role": "user", "content": "1+2?"},
                     {"role": "assistant", "content": "", "tool_calls": [{
                         "id": "c1", "type": "function",
                         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "3"}]})
    ids = asyncio.run(encoder.encode_chat_request(chat, context=4096))
    text = tokenizer.decode(ids)
    assert '"description": "adds <|im_end|> numbers"' in text
    assert '<tool_call>{"arguments": {"a": 1, "b": 2}, "name": "add"}</tool_call>' in text \
        or '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' in text
    # The control-token text of the description is plain text, not the control token.
    end = tokenizer.get_vocab()["<|im_end|>"]
    assert ids.count(end) == 4  # system, user, assistant, tool: the template's own only


def test_a_template_without_tools_gets_them_in_a_system_message() -> None:
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "tools": [{"type": "function", "function": {"name": "add"}}],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "tool_calls": [{
                         "function": {"name": "add", "arguments": '{"a": 1}'}}]}]})
    messages = chat.template_messages(tools_in_template=False)
    assert messages[0]["role"] == "system" and '"name": "add"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>{"name": "add", "arguments": {"a": 1}}' \
                                     '</tool_call>'
    none = ChatCompletionRequest.model_validate({**chat.model_dump(by_alias=True),
                                                 "tool_choice": "none"})
    assert none.template_messages(tools_in_template=False)[0]["role"] == "user"


@pytest.mark.parametrize("in_template", [True, False], ids=["template", "system-message"])
@pytest.mark.parametrize("where", ["tools", "tool_calls"])
def test_tools_and_calls_count_toward_the_character_cap(
        tiny_model_dir: Path, in_template: bool, where: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tool definitions and the calls of the history are rendered into the prompt: too much
    of them is refused on its rendered length, before anything is tokenized."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    if in_template:
        tokenizer.chat_template = (
            "{% for t in tools or [] %}{{ t | tojson }}{% endfor %}{% for m in messages %}"
            "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function | tojson }}"
            "{% endfor %}{% endfor %}")
    encoder = PromptEncoder(tokenizer)
    tokenized: list[int] = []
    monkeypatch.setattr(encoder, "_encode", lambda text, add=False: tokenized.append(1))
    context = 64
    big = "word " * (encoder.max_chars(context) // 5 + 10)
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if where == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "description": big}}]
    else:
        body["messages"].append({"role": "assistant", "content": "", "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "f", "arguments": json.dumps({"text": big})}}]})
    chat = ChatCompletionRequest.model_validate(body)
    with pytest.raises(ApiError) as refused:
        asyncio.run(encoder.encode_chat_request(chat, context))
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    assert tokenized == []


def test_a_tool_message_names_the_call_it_answers() -> None:
    # OpenAI's rule: a tool result without tool_call_id is a 400, not a turn answering nothing.
    history = [{"role": "user", "content": "1+2?"},
               {"role": "assistant", "tool_calls": [{
                   "id": "c1", "type": "function",
                   "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}]
    with pytest.raises(ValueError, match="tool message needs tool_call_id"):
        ChatCompletionRequest.model_validate({
            "model": "m", "messages": [*history, {"role": "tool", "content": "3"}]})
    with pytest.raises(ValueError, match="at least 1"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [
            *history, {"role": "tool", "tool_call_id": "", "content": "3"}]})
    ChatCompletionRequest.model_validate({
        "model": "m", "messages": [*history,
                                   {"role": "tool", "tool_call_id": "c1", "content": "3"}]})
