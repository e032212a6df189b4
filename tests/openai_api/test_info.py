"""The endpoints that describe the model without generating: /v1/models/{id}, and vLLM's
/tokenize, /detokenize and /tokenizer_info, checked against what a real request uses."""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib.metadata import version
from typing import Any

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerBase

from tests.live_servers import LiveServer

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is <|im_end|> in a prompt?"}]


def post(gateway: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=30.0)


def test_tokenize_gives_the_ids_a_request_sends(gateway: LiveServer, client: openai.OpenAI,
                                                base_model: str,
                                                tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = "The quick brown fox"
    out = post(gateway, "/tokenize", {"model": base_model, "prompt": prompt,
                                      "return_token_strs": True}).json()
    assert "tokens" in out, out
    assert out["tokens"] == tokenizer(prompt)["input_ids"] and out["count"] == len(out["tokens"])
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    assert out["max_model_len"] > 0
    done = client.completions.create(model=base_model, prompt=prompt, max_tokens=1)
    assert done.usage is not None and done.usage.prompt_tokens == out["count"]

    chat = post(gateway, "/tokenize", {"model": "a0", "messages": MESSAGES}).json()
    reply = client.chat.completions.create(model="a0", messages=MESSAGES,  # type: ignore[arg-type]
                                           max_tokens=1)
    assert reply.usage is not None and reply.usage.prompt_tokens == chat["count"]
    # Control-token text typed in a message stays text, as in the chat request itself: the
    # only end-of-turn tokens are the template's, one per message.
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chat["tokens"].count(end) == len(MESSAGES)


def test_text_parts_join_with_a_newline_as_in_vllm(gateway: LiveServer,
                                                   base_model: str) -> None:
    def ids(content: Any) -> list[int]:
        out = post(gateway, "/tokenize", {"model": base_model, "messages": [
            {"role": "system", "content": content}, {"role": "user", "content": content}]})
        assert out.status_code == 200, out.text
        return list(out.json()["tokens"])

    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]
    assert ids(parts) == ids("Hi\n there") != ids("Hi there")


def test_detokenize_round_trips(gateway: LiveServer, base_model: str,
                                tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("Hello there, world")["input_ids"]
    assert post(gateway, "/detokenize", {"model": base_model, "tokens": ids}).json() == {
        "prompt": tokenizer.decode(ids)}


def test_model_is_optional_and_special_tokens_as_completions_take_them(
        gateway: LiveServer, client: openai.OpenAI, base_model: str,
        tokenizer: PreTrainedTokenizerBase) -> None:
    """What lm-evaluation-harness's remote tokenizer sends (as to vLLM): no model, and
    add_special_tokens false for a prompt, as /v1/completions takes it."""
    prompt = "The quick brown fox"
    for special in (True, False):
        out = post(gateway, "/tokenize", {"prompt": prompt, "add_special_tokens": special})
        assert out.status_code == 200, out.text
        assert out.json()["tokens"] == tokenizer(prompt, add_special_tokens=special)["input_ids"]
        done = client.completions.create(model=base_model, prompt=prompt, max_tokens=1,
                                         extra_body={"add_special_tokens": special})
        assert done.usage is not None and done.usage.prompt_tokens == out.json()["count"]
    ids = out.json()["tokens"]
    assert post(gateway, "/detokenize", {"tokens": ids}).json() == {
        "prompt": tokenizer.decode(ids)}


CONTINUED = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "The colour is"}]


@pytest.mark.parametrize("options", [
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"chat_template_kwargs": {"enable_thinking": False}},
])
def test_tokenize_takes_the_chat_requests_template_options(
        gateway: LiveServer, client: openai.OpenAI, base_model: str,
        tokenizer: PreTrainedTokenizerBase, options: dict[str, Any]) -> None:
    out = post(gateway, "/tokenize", {"model": base_model, "messages": CONTINUED,
                                      **options}).json()
    assert "tokens" in out, out
    template = {"add_generation_prompt": True, **options}
    kwargs = template.pop("chat_template_kwargs", {})
    rendered = tokenizer.apply_chat_template(CONTINUED, tokenize=True, return_dict=True,
                                             **template, **kwargs)
    assert isinstance(rendered, Mapping)
    assert out["tokens"] == list(rendered["input_ids"])
    reply = client.chat.completions.create(model=base_model, messages=CONTINUED,  # type: ignore[arg-type]
                                           max_tokens=1, extra_body=options)
    assert reply.usage is not None and reply.usage.prompt_tokens == out["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    # Nested deeper than a template's data may be (it is copied recursively).
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"a": [[[1]]] * 2 + [
        json.loads("[" * 500 + "]" * 500)]}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {
        "a": json.loads('{"b":' * 40 + "1" + "}" * 40)}}, "chat_template_kwargs"),
    # What a chat request with the same options refuses.
    ("/tokenize", {"messages": CONTINUED, "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False,
                   "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs"),
    # Chat options with a prompt, fields not implemented, fields of no schema: named.
    ("/tokenize", {"prompt": "x", "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"prompt": "x", "bogus_field": 1}, "bogus_field"),
    ("/detokenize", {"tokens": [1], "bogus_field": 1}, "bogus_field"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, "tokens"),
    ("/detokenize", {"tokens": 5}, "tokens"),
    ("/detokenize", {"tokens": [1] * 100_000}, "tokens"),  # more than any context
])
def test_bad_requests_are_400(gateway: LiveServer, base_model: str, path: str,
                              body: dict[str, Any], param: str | None) -> None:
    response = post(gateway, path, {"model": base_model, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert not error["message"].startswith("Value error")  # no library wording
    if param is not None:
        assert error["param"] == param


def test_an_unknown_model_is_404_everywhere(gateway: LiveServer) -> None:
    for response in (post(gateway, "/tokenize", {"model": "nope", "prompt": "x"}),
                     post(gateway, "/detokenize", {"model": "nope", "tokens": [1]}),
                     httpx.get(gateway.url + "/v1/models/nope", timeout=10.0)):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"


def test_model_cards_and_tokenizer_info(gateway: LiveServer, client: openai.OpenAI,
                                        base_model: str,
                                        tokenizer: PreTrainedTokenizerBase) -> None:
    listed = {m.id: m for m in client.models.list()}
    for name in (base_model, "a0"):
        card = client.models.retrieve(name)
        assert (card.id, card.owned_by) == (name, "loragate")
        assert card.model_dump()["parent"] == listed[name].model_dump()["parent"]
    assert client.models.retrieve("a0").model_dump()["parent"] == base_model
    info = httpx.get(gateway.url + "/tokenizer_info", timeout=10.0).json()
    assert info["eos_token"] == tokenizer.eos_token
    assert info["vocab_size"] == len(tokenizer)
    assert info["chat_template"] == tokenizer.chat_template


def test_version_and_ping_answer_as_vllm_names_them(gateway: LiveServer) -> None:
    assert httpx.get(gateway.url + "/version", timeout=10.0).json() == {
        "version": version("loragate")}
    health = httpx.get(gateway.url + "/health", timeout=10.0)
    for method in ("GET", "POST"):
        ping = httpx.request(method, gateway.url + "/ping", timeout=10.0)
        assert (ping.status_code, ping.json()) == (health.status_code, health.json())
