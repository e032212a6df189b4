"""Every field of OpenAI's completions and chat completions schemas (as the official `openai`
package types them) and of vLLM's extra parameters is honoured or refused with a 400 naming
it: never accepted and silently ignored."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import ChatCompletionStreamOptionsParam
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import BaseModel, ValidationError

from gateway.openai_chat_protocol import ChatCompletionRequest
from gateway.openai_completions_protocol import CompletionRequest
from gateway.openai_fields import CHAT, COMPLETIONS, Unsupported
from gateway.openai_protocol import StreamOptions
from gateway.openai_structured import StructuredOutputs
from tests.live_servers import LiveServer

VLLM_EXTRAS = (
    # vLLM's sampling and prompt extras on both endpoints (its protocol.py), and those on
    # one endpoint only: what a client migrating from vLLM may send.
    "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "response_format", "add_special_tokens",
)
VLLM_032_EXTRAS = (
    # Added by vLLM 0.32's request schemas, both endpoints.
    "request_id", "session_id", "thinking_token_budget", "watermarking", "truncation_side",
    "logprob_token_ids", "return_token_offsets", "repetition_detection", "stream_interval",
    "routed_experts_prompt_start", "mm_payload", "return_mm_kwargs", "ec_transfer_params",
)
VLLM_CHAT_EXTRAS = ("echo", "add_generation_prompt", "continue_final_message",
                    "chat_template", "chat_template_kwargs", "documents",
                    "mm_processor_kwargs", "media_io_kwargs", "include_reasoning",
                    "return_prompt_text")
STREAMING = ("stream",)  # the openai package types it on the streaming variant of the params

ENDPOINTS: dict[str, tuple[type[BaseModel], Mapping[str, Unsupported], tuple[str, ...]]] = {
    "completions": (CompletionRequest, COMPLETIONS, (
        *completion_create_params.CompletionCreateParamsBase.__annotations__, *STREAMING,
        *VLLM_EXTRAS, *VLLM_032_EXTRAS, "prompt_embeds")),
    "chat": (ChatCompletionRequest, CHAT, (
        *chat_create_params.CompletionCreateParamsBase.__annotations__, *STREAMING,
        *VLLM_EXTRAS, *VLLM_032_EXTRAS, *VLLM_CHAT_EXTRAS)),
}
BASE: dict[str, dict[str, Any]] = {
    "completions": {"model": "m", "prompt": "Hi"},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
}

ACTIVE: dict[str, Any] = {
    # A value of each unsupported field that would change the answer if it were honoured.
    "store": True, "metadata": {"k": "v"},
    "service_tier": "flex", "prompt_cache_retention": "24h", "best_of": 3,
    "use_beam_search": True, "length_penalty": 0.5,
    "spaces_between_special_tokens": "yes",  # true and false decode alike (fast tokenizers)
    "logits_processors": ["x"],
    "guided_decoding_backend": "outlines", "guided_whitespace_pattern": " ",
    "kv_transfer_params": {"x": 1}, "vllm_xargs": {"x": 1}, "suffix": "end",
    "add_special_tokens": "flip",  # per endpoint: the opposite of what it does (below)
    "functions": [{"name": "f"}],
    "function_call": "auto", "audio": {"voice": "alloy", "format": "mp3"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high", "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
    "moderation": {"type": "auto"},
    "prompt_cache_options": {"x": 1}, "chat_template": "{{ messages }}",
    "mm_processor_kwargs": {"x": 1},
    "request_id": "trace-1", "session_id": "s", "thinking_token_budget": 100,
    "watermarking": {"x": 1}, "truncation_side": "right", "logprob_token_ids": [1],
    "return_token_offsets": True, "repetition_detection": {"x": 1}, "stream_interval": 4,
    "routed_experts_prompt_start": 3, "mm_payload": "embeds", "return_mm_kwargs": True,
    "ec_transfer_params": {"x": 1}, "prompt_embeds": "AAAA", "media_io_kwargs": {"x": 1},
    "include_reasoning": "yes",  # true and false both change nothing: no reasoning channel
    "return_prompt_text": True,
}


def active_value(endpoint: str, name: str) -> Any:
    value = ACTIVE[name]
    if value == "flip":
        return True  # chat: the template places special tokens; adding more is refused
    return value


CASES = [(endpoint, name) for endpoint, (_, table, _) in ENDPOINTS.items() for name in table]


def test_every_field_is_honoured_or_refused() -> None:
    for endpoint, (model, table, fields) in ENDPOINTS.items():
        unaccounted = sorted(set(fields) - set(model.model_fields) - set(table))
        assert unaccounted == [], f"{endpoint}: fields neither honoured nor refused"
        both = sorted(set(model.model_fields) & set(table))
        assert both == [], f"{endpoint}: fields both declared and refused"
    assert set(ACTIVE) == set(COMPLETIONS) | set(CHAT)  # an example for every refusal


@pytest.mark.parametrize("endpoint, name", CASES)
def test_an_unsupported_field_is_refused_naming_it(endpoint: str, name: str) -> None:
    model, table, _ = ENDPOINTS[endpoint]
    with pytest.raises(ValidationError) as caught:
        model.model_validate({**BASE[endpoint], name: active_value(endpoint, name)})
    [error] = caught.value.errors()
    assert error["loc"] == (name,) and error["msg"].startswith(f"{name} is not supported: ")
    for neutral in (None, *table[name].neutral):  # its neutral values change nothing
        model.model_validate({**BASE[endpoint], name: neutral})


@pytest.mark.parametrize("empty", [[], {}], ids=["list", "map"])
def test_an_empty_container_is_no_boolean(empty: Any) -> None:
    # Neutral there only where the field takes a list or map: `[]` is no `false`.
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({**BASE["completions"],
                                          "spaces_between_special_tokens": empty})
    [error] = caught.value.errors()
    assert error["msg"].endswith("(allowed: true, false)")  # spelt as JSON, as sent
    CompletionRequest.model_validate({**BASE["completions"], "logits_processors": []})


def test_an_empty_object_that_asks_for_a_feature_is_refused() -> None:
    # In OpenAI's API web_search_options: {} turns web search on (all its keys optional).
    with pytest.raises(ValidationError, match="web_search_options is not supported"):
        ChatCompletionRequest.model_validate({**BASE["chat"], "web_search_options": {}})
    ChatCompletionRequest.model_validate({**BASE["chat"], "metadata": {}})  # neutral there


def test_a_bool_is_not_a_number() -> None:
    with pytest.raises(ValidationError):  # True == 1 in Python, not in the API
        CompletionRequest.model_validate({**BASE["completions"], "n": True})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({**BASE["completions"], "echo": 0})
    CompletionRequest.model_validate({**BASE["completions"], "n": 1.0, "echo": False})


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_null_is_the_default_of_every_optional_field(endpoint: str) -> None:
    # OpenAI's schemas mark their optional fields nullable, and clients that write out every
    # field send nulls ("stream": null, "n": null): each means what leaving it out means,
    # completions' max_tokens: null is its default, 16, as in OpenAI's docs and vLLM.
    model, _, fields = ENDPOINTS[endpoint]
    optional = {name for name, field in model.model_fields.items() if not field.is_required()}
    for name in sorted(optional | (set(fields) - set(model.model_fields))):
        request = model.model_validate({**BASE[endpoint], name: None})
        unset = model.model_validate({k: v for k, v in BASE[endpoint].items() if k != name})
        if name in optional and None not in (getattr(unset, name), getattr(request, name)):
            assert getattr(request, name) == getattr(unset, name), name
    assert CompletionRequest.model_validate({**BASE["completions"], "max_tokens": None}
                                            ).max_tokens == 16
    for required in set(model.model_fields) - optional:  # null is no messages, no prompt
        with pytest.raises(ValidationError):
            model.model_validate({**BASE[endpoint], required: None})


def test_a_python_name_is_no_wire_name() -> None:
    # structured_outputs' field json_ is sent as "json": "json_" would be dropped unread by
    # pydantic (a constraint silently ignored), so it is refused as any unknown key.
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({**BASE["chat"], "structured_outputs": {
            "json_": {"type": "object"}}})
    assert caught.value.errors()[0]["loc"] == ("structured_outputs", "json_")


def test_negative_seeds_are_seeds_and_minus_one_is_none(client: openai.OpenAI,
                                                        base_model: str) -> None:
    def draw(seed: int) -> str:
        return client.completions.create(model=base_model, prompt="Hi", max_tokens=8,
                                         temperature=1.0, seed=seed, extra_body={
                                             "ignore_eos": True}).choices[0].text
    assert draw(-5) == draw(-5) == draw(2**64 - 5)  # the same bits, as vLLM reads them
    assert len({draw(-1) for _ in range(3)}) > 1  # -1: no seed (vLLM's "random")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_field_of_neither_schema_is_refused_naming_it(endpoint: str) -> None:
    model = ENDPOINTS[endpoint][0]
    for name, shown in (("x_trace", "x_trace"), ("k" * 5000, "k" * 61 + "...")):
        with pytest.raises(ValidationError) as caught:
            model.model_validate({**BASE[endpoint], name: "abc"})
        [error] = caught.value.errors()
        assert error["loc"] == (shown,)
        assert error["msg"] == f"Unrecognized request argument supplied: {shown}"


def test_a_returned_assistant_message_can_be_sent_back_whole() -> None:
    # Nested objects ignore keys they do not know: the SDK's message objects carry fields
    # (refusal, annotations, audio, ...) that a client sends back in the next turn.
    returned: dict[str, Any] = {"role": "assistant", "content": "Paris.", "refusal": None,
                                "annotations": [], "audio": None, "function_call": None,
                                "tool_calls": None}
    ChatCompletionRequest.model_validate({**BASE["chat"], "messages": [
        {"role": "user", "content": "Capital of France?"}, returned,
        {"role": "user", "content": "And of Spain?"}]})


def test_an_assistant_refusal_in_the_history_is_what_it_said() -> None:
    """OpenAI's refusal field, or a refusal content part, of an earlier answer: its text."""
    for assistant in ({"role": "assistant", "content": None, "refusal": "I can't help."},
                      {"role": "assistant", "content": [
                          {"type": "refusal", "refusal": "I can't help."}]}):
        request = ChatCompletionRequest.model_validate({**BASE["chat"], "messages": [
            {"role": "user", "content": "Help?"}, assistant]})
        assert request.template_messages()[1] == {"role": "assistant",
                                                  "content": "I can't help."}
    with pytest.raises(ValidationError, match="type 'refusal' are not supported"):
        ChatCompletionRequest.model_validate({**BASE["chat"], "messages": [
            {"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]})


@pytest.mark.parametrize("endpoint, name", [("chat", "guided_decoding_backend"),
                                            ("chat", "functions"),
                                            ("completions", "suffix"),
                                            ("chat", "chat_template")])
def test_the_server_answers_400_naming_the_field(gateway: LiveServer, client: openai.OpenAI,
                                                 base_model: str, endpoint: str,
                                                 name: str) -> None:
    extra = {name: active_value(endpoint, name)}
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            client.chat.completions.create(model=base_model, max_tokens=2, extra_body=extra,
                                           messages=[{"role": "user", "content": "Hi"}])
        else:
            client.completions.create(model=base_model, prompt="Hi", max_tokens=2,
                                      extra_body=extra)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == name, error
    assert error["message"].startswith(f"{name} is not supported: "), error  # named once


def test_a_nested_unsupported_field_is_named_once_by_its_path(
        gateway: LiveServer, client: openai.OpenAI, base_model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=base_model, prompt="Hi", max_tokens=2, extra_body={
            "structured_outputs": {"whitespace_pattern": " "}})
    error = caught.value.body
    assert isinstance(error, dict), error
    assert error["message"].startswith(
        "structured_outputs.whitespace_pattern is not supported"), error
    assert error["message"].count("whitespace_pattern") == 1, error
    # OpenAI's allowed_tools form of tool_choice: named as unsupported, not as unknown.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=base_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "allowed_tools", "allowed_tools": {
                "mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}})
    assert caught.value.param == "tool_choice.allowed_tools", caught.value.body
    assert "allowed_tools is not supported: send only the allowed functions" in str(
        caught.value.body)


def test_the_server_answers_400_naming_an_unknown_field(gateway: LiveServer,
                                                       client: openai.OpenAI,
                                                       base_model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=base_model, max_tokens=2,
                                       extra_body={"x_trace": "abc"},
                                       messages=[{"role": "user", "content": "Hi"}])
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "x_trace", error
    assert error["message"] == "Unrecognized request argument supplied: x_trace", error


@pytest.mark.parametrize("name", [*ChatCompletionStreamOptionsParam.__annotations__,
                                  "continuous_usage_stats", "not_a_field"])
def test_stream_options_are_honoured_or_refused_by_name(name: str) -> None:
    # OpenAI's stream options and vLLM's continuous_usage_stats, set to true: each is a field
    # StreamOptions implements (its use is tested end to end) or a refusal naming it.
    for endpoint, (model, _, _) in ENDPOINTS.items():
        body = {**BASE[endpoint], "stream": True, "stream_options": {name: True}}
        try:
            model.model_validate(body)
        except ValidationError as exc:
            assert name not in StreamOptions.model_fields
            assert exc.errors()[0]["loc"][-1] == name, exc
        else:
            assert name in StreamOptions.model_fields


VLLM_STRUCTURED_OUTPUTS = {
    # vLLM's StructuredOutputsParams fields, each with a value that would matter if honoured.
    "json": {"type": "object"}, "regex": "a+", "choice": ["a", "b"], "grammar": "root ::= \"a\"",
    "json_object": True, "disable_fallback": True, "disable_any_whitespace": True,
    "disable_additional_properties": True, "whitespace_pattern": " ",
    "structural_tag": '{"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}',
    "not_a_field": 1,
}


@pytest.mark.parametrize("name", VLLM_STRUCTURED_OUTPUTS)
def test_structured_outputs_fields_are_honoured_or_refused_by_name(name: str) -> None:
    body = {**BASE["completions"], "structured_outputs": {name: VLLM_STRUCTURED_OUTPUTS[name]}}
    if name in ("disable_fallback", "disable_additional_properties"):
        body["structured_outputs"]["regex"] = "a+"  # options of a constraint
    if name == "disable_any_whitespace":
        body["structured_outputs"]["json"] = {"type": "object"}  # an option of JSON output
    fields = {f.alias or n for n, f in StructuredOutputs.model_fields.items()}
    try:
        CompletionRequest.model_validate(body)
    except ValidationError as exc:
        assert name not in fields
        assert exc.errors()[0]["loc"][-1] == name, exc
    else:
        assert name in fields


TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra, compact", [
    ({"response_format": {"type": "json_object"}}, True),
    ({"guided_json": {"type": "object"}}, True),
    ({"tools": TOOL, "tool_choice": "required"}, True),     # its calls are single-line JSON
    ({"tools": TOOL, "tool_choice": {"type": "function", "function": {"name": "f"}}}, True),
    ({"tools": TOOL}, False),                                # auto: free text
    ({"guided_regex": "a+"}, False),
    ({}, False),
])
def test_disable_any_whitespace_needs_json_output(extra: dict[str, Any], compact: bool) -> None:
    body = {**BASE["chat"], **extra, "structured_outputs": {"disable_any_whitespace": True}}
    if not compact:
        with pytest.raises(ValidationError, match="applies to JSON output"):
            ChatCompletionRequest.model_validate(body)
        return
    request = ChatCompletionRequest.model_validate(body)
    spec = request.structured_output() or request.tool_plan().constraint()
    assert spec is not None and not spec.any_whitespace
