"""The engine's own HTTP API (engine/http/server.py): generate, bad input, abort and disconnects.

Against the package's live engine (conftest.py).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from engine.http.errors import NOT_AN_OBJECT_MESSAGE
from tests.engine_server.helpers import (
    CONTEXT,
    GREEDY,
    NUM_KV_BLOCKS,
    error_body,
    get_state,
    long_prompt,
    post_generate,
    post_generate_stream,
    wait_idle,
)

# ---------------------------------------------------------------------------- generate
CHAT_HI = [3, 373, 86, 203, 470, 4, 203, 3, 69, 497, 283, 69, 302, 203]
"""The ChatML prompt of one user message "hi" (the tokenizer's chat template)."""


@pytest.mark.parametrize(("prompt", "lora"), [
    ("The quick brown fox", None),
    ("The quick brown fox", "a0"),
    ("hello world", "a1"),
    (CHAT_HI, "a1"),  # generates bytes that never complete a UTF-8 character
], ids=["text-base", "text-a0", "text-a1", "ids-a1"])
def test_streamed_chunks_add_up_to_the_non_streamed_result(
        http: httpx.Client, tokenizer: PreTrainedTokenizerBase, prompt: str | list[int],
        lora: str | None) -> None:
    field = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    body = {field: prompt, "params": GREEDY, "lora": lora}
    prompt_ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt

    chunks = post_generate_stream(http, {**body, "request_id": "stream-1"})
    assert [c["request_id"] for c in chunks] == ["stream-1"] * len(chunks)
    assert [c["finished"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert [c["completion_tokens"] for c in chunks] == list(range(1, 13))
    assert {c["prompt_tokens"] for c in chunks} == {len(prompt_ids)}
    assert all(len(c["delta_token_ids"]) == 1 and c["error"] is None
               and c["logprobs"] is None for c in chunks)
    token_ids = [t for c in chunks for t in c["delta_token_ids"]]
    text = "".join(c["delta_text"] for c in chunks)
    assert text == tokenizer.decode(token_ids, skip_special_tokens=True)

    final = post_generate(http, {**body, "request_id": "whole-1"})
    assert final["request_id"] == "whole-1"
    assert final["text"] == text
    assert final["delta_token_ids"] == token_ids[-1:]
    assert (final["finished"], final["finish_reason"], final["prompt_tokens"],
            final["completion_tokens"], final["error"]) == (True, "length", len(prompt_ids),
                                                          12, None)
    wait_idle(http)


def test_text_prompt_and_its_token_ids_give_the_same_output(
        http: httpx.Client, tokenizer: PreTrainedTokenizerBase) -> None:
    by_text = post_generate_stream(http, {"prompt": "hello world", "params": GREEDY})
    ids = list(tokenizer("hello world")["input_ids"])
    by_ids = post_generate_stream(http, {"prompt_token_ids": ids, "params": GREEDY})
    assert [c["delta_token_ids"] for c in by_text] == [c["delta_token_ids"] for c in by_ids]
    assert [c["delta_text"] for c in by_text] == [c["delta_text"] for c in by_ids]
    assert by_text[-1]["prompt_tokens"] == by_ids[-1]["prompt_tokens"] == len(ids)


def test_seeded_sampling_repeats_and_stop_strings_cut_the_text(http: httpx.Client) -> None:
    sampled = {"max_tokens": 12, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    first = post_generate(http, {"prompt": "hello world", "params": sampled})
    again = post_generate_stream(http, {"prompt": "hello world", "params": sampled})
    assert "".join(c["delta_text"] for c in again) == first["text"]

    full = post_generate(http, {"prompt": "The quick brown fox", "params": GREEDY})["text"]
    stop = full[5:7]
    cut = post_generate(http, {"prompt": "The quick brown fox",
                               "params": {**GREEDY, "stop": [stop]}})
    assert cut["text"] == full[:full.index(stop)]
    assert (cut["finish_reason"], cut["finished"]) == ("stop", True)
    assert cut["completion_tokens"] < 12
    streamed = post_generate_stream(http, {"prompt": "The quick brown fox",
                                           "params": {**GREEDY, "stop": [stop]}})
    assert "".join(c["delta_text"] for c in streamed) == cut["text"]
    assert streamed[-1]["finish_reason"] == "stop"
    wait_idle(http)


def test_logprobs_come_with_each_delta(http: httpx.Client) -> None:
    chunks = post_generate_stream(http, {"prompt": "hello world",
                                         "params": {**GREEDY, "logprobs": 2}})
    for chunk in chunks:
        (token_id,) = chunk["delta_token_ids"]
        (step,) = chunk["logprobs"]
        # The chosen token plus the 2 most likely: greedy chose the most likely.
        assert len(step) == 2 and str(token_id) in step
        assert step[str(token_id)] == max(step.values())  # greedy picks the top token
        assert all(lp <= 0.0 for lp in step.values())


# ------------------------------------------------------------------------- bad input
TOO_LONG = [7] * (CONTEXT - 4)


@pytest.mark.parametrize(("body", "message", "param"), [
    ({"prompt": "hi", "prompt_token_ids": [5, 6]},
     "give exactly one of prompt and prompt_token_ids", "prompt"),
    ({"params": {"max_tokens": 4}}, "give exactly one of prompt and prompt_token_ids",
     "prompt"),
    ({"prompt": "hi", "lora": "nope"}, "unknown adapter 'nope'", None),
    ({"prompt_token_ids": TOO_LONG},
     f"prompt ({CONTEXT - 4} tokens) + max_tokens (16) = {CONTEXT + 12} exceeds the "
     f"model's context of {CONTEXT} tokens", "max_tokens"),
    ({"prompt": "hi", "params": {"max_tokens": 0}},
     "max_tokens must be an integer in [1, 2147483647], got 0", None),
    ({"prompt": "hi", "params": {"temperature": -1}},
     "temperature must be a finite number >= 0, got -1.0", None),
    ({"prompt_token_ids": [5, 512]}, "prompt token ids out of range [0, 512): [512]",
     "prompt"),
    ({"prompt": ""}, "prompt is empty", None),
    ({"prompt": "hi", "params": {"max_tokens": "x"}},
     "params.max_tokens: must be a number, not a string", "params.max_tokens"),
    ({"prompt": 5}, "prompt: Input should be a valid string", "prompt"),
    ({"prompt_token_ids": "5 6"}, "prompt_token_ids: Input should be a valid list",
     "prompt_token_ids"),
    ({"prompt": "hi", "params": {"top_k": 1.5}},
     "params.top_k: Input should be a valid integer, got a number with a fractional part",
     "params.top_k"),
    ({"prompt": "hi", "temperature": 0}, "temperature: Extra inputs are not permitted",
     "temperature"),
    ({"prompt": "hi", "params": {"seed": 2**64, "temperature": 1}},
     "seed must be an integer in [0, 2**64), got 18446744073709551616", None),
    ({"prompt": "hi", "params": {"seed": -2**63 - 1, "temperature": 1}},
     "seed must be an integer in [0, 2**64), got -9223372036854775809", None),
    ({"prompt": "hi", "params": {"top_k": 2**63}},
     "top_k must be an integer in [0, 2147483647] (0 or -1 disables it), got "
     "9223372036854775808", None),
    ({"prompt_token_ids": [5, 2**40]},
     "prompt token ids out of range [0, 512): [1099511627776]", "prompt"),
], ids=["both-prompts", "no-prompt", "unknown-adapter", "too-long", "max-tokens-0",
        "negative-temperature", "token-out-of-vocab", "empty-prompt", "max-tokens-str",
        "prompt-int", "ids-str", "top-k-float", "unknown-field", "seed-2**64",
        "seed-below-int64", "top-k-2**63", "token-id-2**40"])
def test_bad_generate_requests_are_400_with_openai_errors(
        http: httpx.Client, body: dict[str, Any], message: str, param: str | None) -> None:
    for stream in (True, False):
        error = error_body(http.post("/generate", json={**body, "stream": stream}), 400)
        assert error == {"message": message, "type": "invalid_request_error", "param": param,
                         "code": None}
    assert wait_idle(http)["in_flight"] == 0


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"prompt": "hi",', "the request body is not valid JSON: Expecting property name "
                        "enclosed in double quotes (at character 16)"),
    (b"not json", "the request body is not valid JSON: Expecting value (at character 0)"),
    (b"[1, 2]", NOT_AN_OBJECT_MESSAGE),
    (b"", NOT_AN_OBJECT_MESSAGE),
], ids=["truncated", "garbage", "array", "empty"])
def test_malformed_json_is_400(http: httpx.Client, raw: bytes, message: str) -> None:
    response = http.post("/generate", content=raw,
                         headers={"content-type": "application/json"})
    assert error_body(response, 400) == {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": None}
    assert http.get("/health").status_code == 200


# ----------------------------------------------------------------- abort, disconnects
def test_abort_ends_a_running_request_and_frees_its_blocks(http: httpx.Client) -> None:
    assert http.post("/abort", json={"request_id": "never-sent"}).json() == {"aborted": False}
    long_run = {"prompt": "hello there", "request_id": "to-abort",
                "params": {"max_tokens": 1000, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=long_run) as response:
        lines = response.iter_lines()
        first = json.loads(next(lines))
        assert (first["request_id"], first["finished"]) == ("to-abort", False)
        assert http.post("/abort", json={"request_id": "to-abort"}).json() == {"aborted": True}
        rest = [json.loads(line) for line in lines if line]
    last = rest[-1]
    assert (last["finished"], last["finish_reason"], last["error"]) == (True, "abort", None)
    assert last["completion_tokens"] < 1000
    assert [c["finished"] for c in rest] == [False] * (len(rest) - 1) + [True]
    wait_idle(http)
    assert error_body(http.post("/abort", json={}), 400)["param"] == "request_id"


def test_client_disconnect_mid_stream_frees_the_blocks(http: httpx.Client) -> None:
    long_run = {"prompt_token_ids": long_prompt(1, 100), "request_id": "to-drop",
                "params": {"max_tokens": 800, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=long_run) as response:
        lines = response.iter_lines()
        first = json.loads(next(lines))
        assert (first["request_id"], first["finished"]) == ("to-drop", False)
        state = get_state(http)
        assert (state["num_running"], state["in_flight"]) == (1, 1)
        assert state["kv_blocks_used"] > 0
    # Leaving the block closed the connection: the engine must abort and free everything.
    state = wait_idle(http)
    assert state["kv_blocks_total"] == NUM_KV_BLOCKS
    assert http.get("/health").json() == {"status": "ready", "in_flight": 0}




def test_no_swagger_page_that_would_need_a_cdn(http: httpx.Client) -> None:
    assert http.get("/docs").status_code == 404 and http.get("/redoc").status_code == 404
    assert http.get("/openapi.json").json()["info"]["title"] == "loragate engine"
