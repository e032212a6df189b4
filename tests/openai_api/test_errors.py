"""The gateway's OpenAI-compatible API under bad input: the official client's typed errors
with OpenAI error bodies, and the server healthy afterwards. Against the package's live
engine + gateway (conftest.py).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerBase

from tests.live_http import metric, poll
from tests.live_servers import LiveServer
from tests.openai_api.helpers import (
    CONTEXT,
    MESSAGES,
    assert_healthy,
)


# ----------------------------------------------------------------------------- bad input
def _bad_completion(client: openai.OpenAI, base_model: str, **changes: Any
                    ) -> openai.APIStatusError:
    request: dict[str, Any] = {"model": base_model, "prompt": "hi", "max_tokens": 4, **changes}
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**request)
    return caught.value


def _bad_chat(client: openai.OpenAI, base_model: str, **changes: Any) -> openai.APIStatusError:
    request: dict[str, Any] = {"model": base_model, "messages": MESSAGES, "max_tokens": 4,
                               **changes}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**request)
    return caught.value


def _body(error: openai.APIStatusError) -> dict[str, Any]:
    assert isinstance(error.body, dict)
    assert set(error.body) == {"message", "type", "param", "code"}
    return error.body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_unknown_model_is_404_model_not_found(client: openai.OpenAI, gateway: LiveServer,
                                              base_model: str, stream: bool) -> None:
    for error in (_bad_completion(client, base_model, model="nope", stream=stream),
                  _bad_chat(client, base_model, model="nope", stream=stream)):
        assert isinstance(error, openai.NotFoundError)
        assert _body(error) == {"message": "The model 'nope' does not exist",
                                "type": "invalid_request_error", "param": "model",
                                "code": "model_not_found"}
        # An id to quote, as OpenAI gives one with every answer (the SDK reads it).
        assert (error.request_id or "").startswith("gw-"), error.response.headers
    assert_healthy(gateway, client, base_model)


def test_an_endpoint_not_served_is_a_404_naming_it_and_those_served(
        client: openai.OpenAI, gateway: LiveServer, base_model: str) -> None:
    """A RAG pipeline pointing its embeddings client here learns why nothing answers."""
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model=base_model, input="hi")
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert error["message"] == (
        "no such endpoint: POST /v1/embeddings; of the OpenAI API this server has "
        "/v1/chat/completions, /v1/completions, /v1/responses and /v1/models")
    other = httpx.get(gateway.url + "/" + "x" * 300, timeout=30.0)
    assert other.status_code == 404
    assert other.json()["error"]["message"] == f"no such endpoint: GET /{'x' * 119}..."
    doubled = httpx.post(gateway.url + "//v1/chat/completions", json={}, timeout=30.0)
    assert doubled.status_code == 404  # its path as sent, not "//v1" read as a host
    assert doubled.json()["error"]["message"].startswith(
        "no such endpoint: POST //v1/chat/completions"), doubled.text


def test_prompt_longer_than_the_context_is_400(client: openai.OpenAI, gateway: LiveServer,
                                               tokenizer: PreTrainedTokenizerBase,
                                               base_model: str) -> None:
    prompt = "a " * CONTEXT
    prompt_tokens = len(tokenizer(prompt)["input_ids"])
    error = _bad_completion(client, base_model, prompt=prompt)
    assert isinstance(error, openai.BadRequestError)
    assert _body(error) == {
        "message": f"This model's maximum context length is {CONTEXT} tokens; the prompt has "
                   f"{prompt_tokens} tokens",
        "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}
    messages = [{"role": "user", "content": prompt}]
    error = _bad_chat(client, base_model, messages=messages, stream=True)
    assert isinstance(error, openai.BadRequestError)
    assert (_body(error)["param"], error.code) == ("messages", "context_length_exceeded")
    assert_healthy(gateway, client, base_model)


@pytest.mark.parametrize(("endpoint", "changes", "param"), [
    ("completions", {"max_tokens": "x"}, "max_tokens"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"prompt": 5}, "prompt"),  # a union: one error per member type
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 10**9}, "max_tokens"),
    ("completions", {"n": 129}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.[0].role"),
    ("chat", {"max_tokens": "x"}, "max_tokens"),
    ("chat", {"max_tokens": 10**9}, "max_tokens"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages.[0]"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]},
     "messages.[0].content"),
], ids=["max-tokens-str", "temperature-str", "prompt-int", "max-tokens-0",
        "max-tokens-huge", "n-17", "logprobs-21", "chat-no-messages", "chat-bad-role",
        "chat-max-tokens-str", "chat-max-tokens-huge", "chat-n-0", "chat-top-logprobs-alone",
        "chat-user-null-content", "chat-image-part"])
def test_invalid_requests_are_400(client: openai.OpenAI, gateway: LiveServer,
                                  base_model: str, endpoint: str, changes: dict[str, Any],
                                  param: str | None) -> None:
    bad = _bad_completion if endpoint == "completions" else _bad_chat
    for stream in (False, True):
        error = bad(client, base_model, stream=stream, **changes)
        assert isinstance(error, openai.BadRequestError), error
        body = _body(error)
        assert (body["type"], body["param"]) == ("invalid_request_error", param)
        assert body["message"]
    assert_healthy(gateway, client, base_model)


@pytest.mark.parametrize(("endpoint", "changes", "message", "param"), [
    ("completions", {"n": 3, "best_of": 2}, "best_of (2) must be at least n (3)", "best_of"),
    ("completions", {"stop": ""}, "stop: String should have at least 1 character", "stop"),
    ("completions", {"cache_salt": ""}, "cache_salt: String should have at least 1 character",
     "cache_salt"),
    ("chat", {"user": "u" * 257}, "user: String should have at most 256 characters", "user"),
    ("chat", {"messages": [{"role": "bot", "content": "x"}]},
     "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or "
     "'tool'", "messages.[0].role"),
    ("chat", {"messages": [{"role": "user", "content": "x", "name": 5}]},
     "messages[0].name: Input should be a valid string", "messages.[0].name"),
    ("chat", {"continue_final_message": True},
     "continue_final_message=true needs add_generation_prompt=false: the last message is "
     "continued, not answered", "continue_final_message"),
    ("chat", {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "3"}]},
     "a tool message needs tool_call_id (the id of the call it answers)",
     "messages.[1].tool_call_id"),
    ("chat", {"response_format": {"type": "json_object", "schema": {"type": "integer"}}},
     "response_format.schema: Unrecognized request argument supplied: schema",
     "response_format.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "foo": 1}}},
     "response_format.json_schema.foo: Unrecognized request argument supplied: foo",
     "response_format.json_schema.foo"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "f"}, "foo": 1}},
     "tool_choice.foo: Unrecognized request argument supplied: foo", "tool_choice.foo"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]},
     'tools[0].function.parameters: a function\'s parameters must be a JSON schema of type '
     'object, not "string"', "tools.[0].function.parameters"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "enum": ["a", "b"]}}}]},
     "tools[0].function.parameters: a function's parameters must be a JSON schema of type "
     "object, not a schema of enum", "tools.[0].function.parameters"),
], ids=["best-of-below-n", "empty-stop", "empty-salt", "long-user", "bad-role", "name-not-text",
        "continue-and-add", "tool-without-call-id", "json-object-with-schema",
        "json-schema-extra-key", "tool-choice-extra-key", "parameters-not-an-object",
        "parameters-of-enum"])
def test_validation_messages_say_where_without_library_noise(
        gateway: LiveServer, base_model: str, endpoint: str, changes: dict[str, Any],
        message: str, param: str) -> None:
    # A path as the client wrote it; no pydantic wording ("Value error,", "body:", the
    # members of a union a value failed to be).
    request: dict[str, Any] = {"model": base_model, "max_tokens": 4, **(
        {"prompt": "hi"} if endpoint == "completions" else {"messages": MESSAGES}), **changes}
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    response = httpx.post(gateway.url + path, json=request, timeout=30.0)
    assert response.status_code == 400
    assert response.json()["error"] == {"message": message, "type": "invalid_request_error",
                                         "param": param, "code": None}


NOT_AN_OBJECT = ("the request body must be a JSON object, sent with Content-Type: "
                 "application/json")


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"model": "m", "prompt": "hi",', "the request body is not valid JSON: Expecting "
                                        "property name enclosed in double quotes (at "
                                        "character 30)"),
    (b"not json", "the request body is not valid JSON: Expecting value (at character 0)"),
    (b"[]", NOT_AN_OBJECT),
    (b'{"model": "m", "prompt": "hi"}', NOT_AN_OBJECT),  # sent as text/plain
    (b"", NOT_AN_OBJECT),
], ids=["truncated", "garbage", "array", "text-plain", "empty"])
def test_malformed_json_is_400(gateway: LiveServer, client: openai.OpenAI, base_model: str,
                               raw: bytes, message: str, request: pytest.FixtureRequest
                               ) -> None:
    kind = "text/plain" if "text-plain" in request.node.name else "application/json"
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(gateway.url + path, content=raw, headers={"content-type": kind})
        assert response.status_code == 400
        assert response.json() == {"error": {"message": message,
                                             "type": "invalid_request_error", "param": None,
                                             "code": None}}
    assert_healthy(gateway, client, base_model)


def test_a_body_over_8_mib_is_413(gateway: LiveServer, client: openai.OpenAI,
                                  base_model: str) -> None:
    huge = "x" * (9 << 20)
    error = _bad_completion(client, base_model, prompt=huge)
    assert error.status_code == 413
    assert _body(error)["type"] == "invalid_request_error"
    # Without a Content-Length (chunked upload) the limit holds all the same.
    body = json.dumps({"model": base_model, "prompt": huge, "max_tokens": 4}).encode()

    def chunked() -> Iterator[bytes]:
        for start in range(0, len(body), 1 << 20):
            yield body[start:start + (1 << 20)]

    response = httpx.post(gateway.url + "/v1/completions", content=chunked(),
                          headers={"content-type": "application/json"}, timeout=60.0)
    assert response.status_code == 413, response.text[:300]
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert_healthy(gateway, client, base_model)


def test_a_client_still_uploading_reads_the_413(gateway: LiveServer, client: openai.OpenAI,
                                                base_model: str) -> None:
    # The 413 goes out on the headers while the body is still arriving. Closed at once,
    # the socket would reset under the client's upload, and the client would see a broken
    # pipe instead of the answer (the openai SDK then uploads it all again, twice).
    address = urlsplit(gateway.url)
    body = b'{"model": "m", "prompt": "' + b"x" * (9 << 20) + b'"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {address.hostname}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    for _ in range(3):
        with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
            sock.sendall(head.encode() + body)
            answer = b""
            while chunk := sock.recv(65536):  # the server closes once the answer is out
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == \
            "request_too_large"
    assert_healthy(gateway, client, base_model)


@pytest.mark.parametrize("against", ["min_tokens", "grammar"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_constraints_that_allow_no_token_end_the_request_with_a_400(
        client: openai.OpenAI, gateway: LiveServer, base_model: str,
        tokenizer: PreTrainedTokenizerBase, stream: bool, against: str) -> None:
    # Only the end-of-sequence token is allowed, and min_tokens bans it, or the grammar
    # wants a word first: nothing may come next. The request ends with an error instead of
    # emitting a forbidden token, and the requests beside it go on.
    eos = tokenizer.eos_token_id
    assert eos is not None
    changes: dict[str, Any] = {"allowed_token_ids": [eos], **(
        {"min_tokens": 2} if against == "min_tokens" else {"guided_choice": ["hello"]})}
    body = {"model": base_model, "prompt": "hi", "max_tokens": 4, "stream": stream, **changes}

    def counted() -> float:  # streams that began (200) and ended with this error event
        return metric(httpx.get(gateway.url + "/metrics", timeout=30.0).text,
                      "loragate_gateway_responses_total", route="/v1/completions",
                      status="200", code="invalid_request")

    before = counted()
    with httpx.Client(base_url=gateway.url, timeout=30.0) as http:
        answer = http.post("/v1/completions", json=body)
    # Counted with its error's code, not as a clean 200 (once the response has ended).
    poll(lambda: counted() == before + stream, "the response to be counted")
    if stream:  # the stream had begun: its error is an event, then the stream ends
        assert answer.status_code == 200
        events = [json.loads(line[6:]) for line in answer.text.splitlines()
                  if line.startswith("data: {")]
        assert [e for e in events if "choices" in e and e["choices"][0]["text"]] == []
        error = events[-1]["error"]
    else:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    assert "no token is allowed" in error["message"]
    allowed = client.completions.create(model=base_model, prompt="hi", max_tokens=3,
                                        extra_body={"allowed_token_ids": [eos, 5, 6],
                                                    "min_tokens": 3})
    assert allowed.choices[0].finish_reason == "length"  # 5 and 6 were left
    assert_healthy(gateway, client, base_model)


def test_a_grammar_too_costly_to_match_ends_its_request_not_the_engine(
        client: openai.OpenAI, gateway: LiveServer, base_model: str,
        tokenizer: PreTrainedTokenizerBase) -> None:
    # Nested repetitions of overlapping alternatives compile at once, then their matching
    # grows about 1.6x a token (here past 0.1 s of CPU by the 8th "a"): the request ends
    # with a 400 before it stalls the engine's steps, and the engine serves on.
    a = tokenizer.convert_tokens_to_ids("a")
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=base_model, prompt="hi", max_tokens=60, extra_body={
            "guided_regex": "((a|aa)*){1,100}c", "allowed_token_ids": [a]})
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "invalid_request", error
    assert "too costly to match" in error["message"] and "(a|aa)*" in error["message"]
    assert_healthy(gateway, client, base_model)
