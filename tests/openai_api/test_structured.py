"""Structured outputs through the live gateway and engine (the tiny random model: whatever
it prefers, the grammar decides what may come out): choices, regular expressions, JSON
objects and schemas, EBNF grammars, vLLM's structural tags, in every spelling a client may
use (OpenAI's response_format, vLLM's structured_outputs and guided_*), streamed or not, and
clear 400s for specs that are wrong or conflict."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from tests.live_servers import LiveServer
from tests.openai_api.helpers import MESSAGES

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"], "additionalProperties": False}


def _chat(client: openai.OpenAI, base_model: str, **extra: Any) -> tuple[str, str]:
    reply = client.chat.completions.create(model=base_model, messages=MESSAGES, max_tokens=60,
                                           temperature=0.7, seed=7, extra_body=extra)
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason


@pytest.mark.parametrize("extra", [
    {"guided_choice": ["alpha", "beta", "gamma"]},
    {"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
])
def test_a_choice_is_one_of_the_choices(client: openai.OpenAI, base_model: str,
                                        extra: dict[str, Any]) -> None:
    for _ in range(3):
        text, finish = _chat(client, base_model, **extra)
        assert (text, finish) in {("alpha", "stop"), ("beta", "stop"), ("gamma", "stop")}


def test_logprobs_are_those_of_the_tokens_the_grammar_allows(client: openai.OpenAI,
                                                              base_model: str) -> None:
    """As vLLM reports them: the distribution over the allowed tokens (the grammar masks
    the raw logits first), so every alternative can continue a choice and the chosen
    token's probability is at least what it is unconstrained."""
    choices = ["alpha", "beta", "gamma"]

    def first_step(**extra: Any) -> Any:
        reply = client.chat.completions.create(
            model=base_model, messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True,
            top_logprobs=5, extra_body=extra)
        assert reply.choices[0].logprobs is not None
        return reply.choices[0].logprobs.content[0]  # type: ignore[index]

    step = first_step(structured_outputs={"choice": choices})
    allowed = [t for t in step.top_logprobs if t.logprob > -9999.0]
    assert allowed and all(any(c.startswith(t.token) for c in choices) for t in allowed)
    assert sum(2.718281828459045 ** t.logprob for t in allowed) <= 1.0 + 1e-4
    free = {t.token: t.logprob for t in first_step().top_logprobs}
    if step.token in free:
        assert step.logprob >= free[step.token]


def test_a_regex_is_matched_whole(client: openai.OpenAI, base_model: str) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    done = client.completions.create(model=base_model, prompt="code:", max_tokens=20,
                                     temperature=1.0, seed=3,
                                     extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, done.choices[0].text)
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}},
    {"guided_json": SCHEMA},
    {"structured_outputs": {"json": json.dumps(SCHEMA)}},
])
def test_json_matches_its_schema(client: openai.OpenAI, base_model: str,
                                 extra: dict[str, Any]) -> None:
    text, finish = _chat(client, base_model, **extra)
    if finish == "stop":  # "length": the random model filled max_tokens with whitespace
        value = json.loads(text)
        assert set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue")
        assert isinstance(value["ok"], bool)
    else:
        assert text.lstrip().startswith("{")


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}},
    {"response_format": {"type": "json_object"}},
    {"guided_json": SCHEMA},
    {"structured_outputs": {"json": SCHEMA}},
])
def test_compact_json_whichever_field_asks_for_json(client: openai.OpenAI, base_model: str,
                                                     extra: dict[str, Any]) -> None:
    """structured_outputs.disable_any_whitespace holds the request's JSON to compact form,
    wherever the JSON constraint comes from (vLLM merges response_format into its
    structured outputs): the random model, free to, fills its budget with whitespace."""
    so = {**extra.get("structured_outputs", {}), "disable_any_whitespace": True}
    text, finish = _chat(client, base_model, **{**extra, "structured_outputs": so})
    # No free whitespace: only the one space after each ':' and ',' that xgrammar's compact
    # form writes (as json.dumps does).
    if finish == "stop":
        assert text == json.dumps(json.loads(text), ensure_ascii=False), text
    else:  # cut at max_tokens: no whitespace outside those separators so far
        assert not re.search(r"\s\s|\n|[{\[]\s", text), text


def test_a_grammar_and_a_streamed_constraint(client: openai.OpenAI, base_model: str) -> None:
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    text, finish = _chat(client, base_model, guided_grammar=grammar)
    assert re.fullmatch(r"yes|no|maybe [0-9]", text) and finish == "stop"
    streamed = client.chat.completions.create(
        model=base_model, messages=MESSAGES, max_tokens=20, stream=True,
        extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{1,5}!"}})
    whole = "".join(e.choices[0].delta.content or "" for e in streamed if e.choices)
    assert re.fullmatch("[A-Z][a-z]{1,5}!", whole)


def test_json_object_is_an_object(client: openai.OpenAI, base_model: str) -> None:
    text, finish = _chat(client, base_model, response_format={"type": "json_object"})
    assert text.lstrip().startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("body", [
    {"guided_regex": "([a-z"},                                     # not a regex
    {"guided_json": "{not json"},                                  # not JSON
    {"guided_grammar": "root ::= undefined_rule"},                 # not a grammar
    {"guided_choice": []},
    {"guided_regex": "a+", "guided_choice": ["a"]},                # two constraints
    {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
    {"response_format": {"type": "json_schema"}},                  # no schema
    {"guided_regex": "a+", "ignore_eos": True},                    # never ends
    {"structured_outputs": {"disable_any_whitespace": True}},     # no JSON to compact
    {"guided_regex": "a+", "structured_outputs": {"disable_any_whitespace": True}},
])
def test_bad_structured_output_requests_are_400(gateway: LiveServer, base_model: str,
                                                body: dict[str, Any]) -> None:
    answer = httpx.post(gateway.url + "/v1/chat/completions", timeout=30.0, json={
        "model": base_model, "messages": MESSAGES, "max_tokens": 4, **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, "response_format"),
    # Keywords the grammar would ignore (a schema the output would then break).
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
        "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {
            "n": {"type": "number", "multipleOf": 7}}}}}]}, "tools.[0].function.parameters"),
    # vLLM's structural tags, malformed.
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>"}],
                          "triggers": ["<a"]}}, "response_format"),
    ({"response_format": {"type": "json_object", "triggers": ["<a"]}},
     "response_format.triggers"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "no-such-format"}}},
     "response_format"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "[" * 1200 + "]" * 1200}},
     "structured_outputs"),  # nested past what parsing it recursively reaches (a 500)
    ({"structured_outputs": {"structural_tag": json.dumps({"format": {
        "type": "tag", "begin": "<a>", "end": "</a>", "content": {
            "type": "qwen_xml_parameter", "json_schema": {"type": "object", "properties": {
                "x": {"type": "array", "uniqueItems": True}}}}}})}},
     "structured_outputs"),  # a schema in any content kind is checked
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": json.dumps({"structures": [
        {"begin": "<a>", "schema": {"type": "array", "uniqueItems": True}, "end": "</a>"}],
        "triggers": ["<a"]})}}, "structured_outputs"),  # a keyword it would not hold
])
def test_a_spec_that_does_not_compile_is_refused_naming_its_field(
        gateway: LiveServer, base_model: str, body: dict[str, Any], param: str) -> None:
    answer = httpx.post(gateway.url + "/v1/chat/completions", timeout=30.0, json={
        "model": base_model, "messages": MESSAGES, "max_tokens": 4, **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text
    assert not answer.json()["error"]["message"].startswith("Value error")


COUNT = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
         "additionalProperties": False}
SECTION = re.compile(r"<r>(.*?)</r>", re.DOTALL)


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<r>", "content": {"type": "json_schema", "json_schema": COUNT},
        "end": "</r>"}}},
    {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<r>", "content": {"type": "json_schema", "json_schema": COUNT},
        "end": "</r>"}})}},
])
def test_a_structural_tag_holds_its_section(client: openai.OpenAI, base_model: str,
                                            extra: dict[str, Any]) -> None:
    # vLLM's structural tags, xgrammar's format: the whole answer is the one tag here.
    text, finish = _chat(client, base_model, **extra)
    assert finish == "stop" and text.startswith("<r>") and text.endswith("</r>"), text
    assert set(json.loads(SECTION.fullmatch(text).group(1))) == {"n"}  # type: ignore[union-attr]


def test_a_legacy_structural_tag_holds_what_each_trigger_starts(client: openai.OpenAI,
                                                                base_model: str) -> None:
    # vLLM's older form: free text, and after a trigger one of the structures (whether the
    # tiny model writes a trigger is its own affair: tests/test_structural_tags.py holds the
    # grammar to the form).
    tag = {"structures": [{"begin": "<r>", "schema": COUNT, "end": "</r>"}],
           "triggers": ["<r"]}
    text, _ = _chat(client, base_model, response_format={"type": "structural_tag", **tag})
    for section in SECTION.findall(text):
        assert set(json.loads(section)) == {"n"}, text
    answer = client.chat.completions.create(
        model=base_model, messages=MESSAGES, max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}})
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_the_xgrammar_backend_name_is_accepted(client: openai.OpenAI, base_model: str) -> None:
    text, _ = _chat(client, base_model, guided_choice=["x", "y"],
                    guided_decoding_backend="xgrammar")
    assert text in ("x", "y")


def test_a_tools_unenforced_keyword_is_named_in_the_users_terms(gateway: LiveServer,
                                                                 base_model: str) -> None:
    # The function and the pointer into its own parameters, not into the grammar's wrapping.
    tool: dict[str, Any] = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    # Not strict: held as well as the grammar can, as OpenAI only tries to fit its arguments.
    best_effort = httpx.post(gateway.url + "/v1/chat/completions", timeout=30.0, json={
        "model": base_model, "messages": MESSAGES, "max_tokens": 4, "tools": [tool],
        "tool_choice": "required"})
    assert best_effort.status_code == 200, best_effort.text
    tool["function"]["strict"] = True
    answer = httpx.post(gateway.url + "/v1/chat/completions", timeout=30.0, json={
        "model": base_model, "messages": MESSAGES, "max_tokens": 4, "tools": [tool],
        "tool_choice": "required"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "tools.[0].function.parameters"
    assert answer.json()["error"]["message"].startswith(
        "the parameters of function 'tag': `uniqueItems` at #/properties/tags: ")
