"""The engine's own HTTP API (engine/server.py) against a live `loragate engine` process.

One engine for the module: the tiny model, two PEFT adapters registered with --lora, and a
64-block KV cache, so a leaked block shows up in /state. Every test that runs requests
ends by polling /state until nothing runs and no block is in use.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from prefix_cache.hashing import chain_hashes, sparse_chain
from tests.live_servers import LiveServer, start_engine

NUM_KV_BLOCKS = 64
BLOCK_SIZE = 16
CONTEXT = 1024  # the tiny model's max_position_embeddings
PUBLISH_EVERY = 4
STATE_FIELDS = {
    "instance_id", "model", "draining", "in_flight", "num_running", "num_waiting",
    "num_swapped", "kv_blocks_used", "kv_blocks_total", "max_loras", "max_num_seqs",
    "block_size", "publish_every", "max_model_len", "max_request_tokens", "prefix_hit_rate",
    "kv_pools", "adapters", "prefix",
}
ADAPTER_FIELDS = {"name", "path", "digest", "rank", "in_cpu", "slot", "pinned",
                  "running_requests"}
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def adapters(tiny_adapters: dict[str, Path]) -> dict[str, Path]:
    return tiny_adapters


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine-server-logs"),
                          "--num-kv-blocks", str(NUM_KV_BLOCKS), adapters=adapters,
                          instance_id="engine-under-test")
    try:
        yield server.wait_ready()
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]  # SIGTERM drains and exits cleanly


@pytest.fixture(scope="module")
def http(engine: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


# ----------------------------------------------------------------------------- helpers
def _stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in response.iter_lines() if line]


def _generate(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post("/generate", json={**body, "stream": False})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _state(http: httpx.Client, cursor: int = 0) -> dict[str, Any]:
    response = http.get("/state", params={"cursor": cursor})
    assert response.status_code == 200
    state: dict[str, Any] = response.json()
    return state


def _wait_idle(http: httpx.Client) -> dict[str, Any]:
    """Poll /state until no request runs or waits and no KV block is referenced."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        state = _state(http)
        if (state["num_running"], state["num_waiting"], state["kv_blocks_used"],
                state["in_flight"]) == (0, 0, 0, 0):
            return state
        assert time.monotonic() < deadline, f"engine not idle: {state}"
        time.sleep(0.02)


def _metric(text: str, series: str) -> float:
    """The value of one exposition line, e.g. 'loragate_kv_pool_used_blocks{pool="base"}'."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.rsplit(" ", 1)[0] == series]
    assert len(values) == 1, f"{series} appears {len(values)} times"
    return values[0]


def _long_prompt(seed: int, length: int = 200) -> list[int]:
    """A prompt no other test sends (ids past the tokenizer's special tokens 0-4)."""
    rng = random.Random(seed)
    return [rng.randrange(5, 512) for _ in range(length)]


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


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

    chunks = _stream(http, {**body, "request_id": "stream-1"})
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

    final = _generate(http, {**body, "request_id": "whole-1"})
    assert final["request_id"] == "whole-1"
    assert final["text"] == text
    assert final["delta_token_ids"] == token_ids[-1:]
    assert (final["finished"], final["finish_reason"], final["prompt_tokens"],
            final["completion_tokens"], final["error"]) == (True, "length", len(prompt_ids),
                                                          12, None)
    _wait_idle(http)


def test_text_prompt_and_its_token_ids_give_the_same_output(
        http: httpx.Client, tokenizer: PreTrainedTokenizerBase) -> None:
    by_text = _stream(http, {"prompt": "hello world", "params": GREEDY})
    ids = list(tokenizer("hello world")["input_ids"])
    by_ids = _stream(http, {"prompt_token_ids": ids, "params": GREEDY})
    assert [c["delta_token_ids"] for c in by_text] == [c["delta_token_ids"] for c in by_ids]
    assert [c["delta_text"] for c in by_text] == [c["delta_text"] for c in by_ids]
    assert by_text[-1]["prompt_tokens"] == by_ids[-1]["prompt_tokens"] == len(ids)


def test_seeded_sampling_repeats_and_stop_strings_cut_the_text(http: httpx.Client) -> None:
    sampled = {"max_tokens": 12, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    first = _generate(http, {"prompt": "hello world", "params": sampled})
    again = _stream(http, {"prompt": "hello world", "params": sampled})
    assert "".join(c["delta_text"] for c in again) == first["text"]

    full = _generate(http, {"prompt": "The quick brown fox", "params": GREEDY})["text"]
    stop = full[5:7]
    cut = _generate(http, {"prompt": "The quick brown fox",
                           "params": {**GREEDY, "stop": [stop]}})
    assert cut["text"] == full[:full.index(stop)]
    assert (cut["finish_reason"], cut["finished"]) == ("stop", True)
    assert cut["completion_tokens"] < 12
    streamed = _stream(http, {"prompt": "The quick brown fox",
                              "params": {**GREEDY, "stop": [stop]}})
    assert "".join(c["delta_text"] for c in streamed) == cut["text"]
    assert streamed[-1]["finish_reason"] == "stop"
    _wait_idle(http)


def test_logprobs_come_with_each_delta(http: httpx.Client) -> None:
    chunks = _stream(http, {"prompt": "hello world", "params": {**GREEDY, "logprobs": 2}})
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
     f"model's context of {CONTEXT} tokens", None),
    ({"prompt": "hi", "params": {"max_tokens": 0}},
     "max_tokens must be an integer >= 1, got 0", None),
    ({"prompt": "hi", "params": {"temperature": -1}}, "temperature must be >= 0, got -1.0",
     None),
    ({"prompt_token_ids": [5, 512]}, "prompt token ids out of range [0, 512): [512]", None),
    ({"prompt": ""}, "prompt is empty", None),
    ({"prompt": "hi", "params": {"max_tokens": "x"}},
     "params.max_tokens: Input should be a valid integer, unable to parse string as an "
     "integer", "max_tokens"),
    ({"prompt": 5}, "prompt: Input should be a valid string", "prompt"),
    ({"prompt_token_ids": "5 6"}, "prompt_token_ids: Input should be a valid list",
     "prompt_token_ids"),
    ({"prompt": "hi", "params": {"top_k": 1.5}},
     "params.top_k: Input should be a valid integer, got a number with a fractional part",
     "top_k"),
    ({"prompt": "hi", "temperature": 0}, "temperature: Extra inputs are not permitted",
     "temperature"),
], ids=["both-prompts", "no-prompt", "unknown-adapter", "too-long", "max-tokens-0",
        "negative-temperature", "token-out-of-vocab", "empty-prompt", "max-tokens-str",
        "prompt-int", "ids-str", "top-k-float", "unknown-field"])
def test_bad_generate_requests_are_400_with_openai_errors(
        http: httpx.Client, body: dict[str, Any], message: str, param: str | None) -> None:
    for stream in (True, False):
        error = _error(http.post("/generate", json={**body, "stream": stream}), 400)
        assert error == {"message": message, "type": "invalid_request_error", "param": param,
                         "code": None}
    assert _wait_idle(http)["in_flight"] == 0


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"prompt": "hi",', "the request body is not valid JSON: Expecting property name "
                        "enclosed in double quotes (at character 16)"),
    (b"not json", "the request body is not valid JSON: Expecting value (at character 0)"),
    (b"[1, 2]", "body: Input should be a valid dictionary or object to extract fields from"),
    (b"", "body: Field required"),
], ids=["truncated", "garbage", "array", "empty"])
def test_malformed_json_is_400(http: httpx.Client, raw: bytes, message: str) -> None:
    response = http.post("/generate", content=raw,
                         headers={"content-type": "application/json"})
    assert _error(response, 400) == {"message": message, "type": "invalid_request_error",
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
    _wait_idle(http)
    assert _error(http.post("/abort", json={}), 400)["param"] == "request_id"


def test_client_disconnect_mid_stream_frees_the_blocks(http: httpx.Client) -> None:
    long_run = {"prompt_token_ids": _long_prompt(1, 100), "request_id": "to-drop",
                "params": {"max_tokens": 800, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=long_run) as response:
        lines = response.iter_lines()
        first = json.loads(next(lines))
        assert (first["request_id"], first["finished"]) == ("to-drop", False)
        state = _state(http)
        assert (state["num_running"], state["in_flight"]) == (1, 1)
        assert state["kv_blocks_used"] > 0
    # Leaving the block closed the connection: the engine must abort and free everything.
    state = _wait_idle(http)
    assert state["kv_blocks_total"] == NUM_KV_BLOCKS
    assert http.get("/health").json() == {"status": "ready", "in_flight": 0}


# ----------------------------------------------------------------------- state, prefix
def test_state_reports_config_load_and_adapters(http: httpx.Client,
                                                adapters: dict[str, Path]) -> None:
    state = _wait_idle(http)
    assert set(state) == STATE_FIELDS
    assert (state["instance_id"], state["draining"], state["num_swapped"],
            state["kv_blocks_total"], state["block_size"], state["publish_every"],
            state["max_model_len"], state["max_loras"], state["max_request_tokens"]) == (
        "engine-under-test", False, 0, NUM_KV_BLOCKS, BLOCK_SIZE, PUBLISH_EVERY, CONTEXT, 4,
        min(CONTEXT, NUM_KV_BLOCKS * BLOCK_SIZE))
    listed = {a["name"]: a for a in state["adapters"]}
    assert set(listed) == {"a0", "a1"}
    for name, info in listed.items():
        assert set(info) == ADAPTER_FIELDS
        assert info["path"] == str(adapters[name].resolve())
        assert len(info["digest"]) == 32 and int(info["digest"], 16) >= 0
        assert (info["rank"], info["pinned"], info["running_requests"]) == (8, False, 0)
    assert listed["a0"]["digest"] != listed["a1"]["digest"]
    assert http.get("/adapters").json() == state["adapters"]


def test_prefix_hashes_are_published_after_a_long_prompt(http: httpx.Client) -> None:
    cursor = _state(http)["prefix"]["cursor"]
    prompt = _long_prompt(2)  # 12 full blocks: the 4th, 8th and 12th are published
    _generate(http, {"prompt_token_ids": prompt, "params": {**GREEDY, "max_tokens": 2}})
    update = _state(http, cursor)["prefix"]
    expected = {format(h, "x") for _, h in
                sparse_chain(chain_hashes(prompt, BLOCK_SIZE), PUBLISH_EVERY)}
    assert len(expected) == 3
    assert update["full"] is False
    assert set(update["added"]) == expected
    assert update["cursor"] == cursor + len(update["added"]) + len(update["removed"])
    assert all(int(h, 16) >= 0 for h in update["added"] + update["removed"])
    # Nothing new since the new cursor; a full snapshot (cursor 0) holds the hashes too.
    assert _state(http, update["cursor"])["prefix"] == {
        "cursor": update["cursor"], "full": False, "added": [], "removed": []}
    snapshot = _state(http, 0)["prefix"]
    assert snapshot["full"] is True and expected <= set(snapshot["added"])
    _wait_idle(http)


# -------------------------------------------------------------------------- adapters
def test_adapter_register_pin_and_unregister(http: httpx.Client,
                                             adapters: dict[str, Path]) -> None:
    a1 = {a["name"]: a for a in http.get("/adapters").json()}["a1"]
    loaded = http.post("/adapters", json={"name": "a1-copy", "path": str(adapters["a1"])})
    assert loaded.status_code == 200
    assert loaded.json() == {"name": "a1-copy", "digest": a1["digest"], "rank": 8}

    pinned = http.post("/adapters/a1-copy/pin", json={"pinned": True})
    assert pinned.json() == {"name": "a1-copy", "pinned": True}
    copy = {a["name"]: a for a in http.get("/adapters").json()}["a1-copy"]
    assert copy["pinned"] is True and copy["digest"] == a1["digest"]
    # Same weights under another name: the same greedy tokens.
    body = {"prompt": "hello world", "params": GREEDY}
    by_copy = _stream(http, {**body, "lora": "a1-copy"})
    by_a1 = _stream(http, {**body, "lora": "a1"})
    assert [c["delta_token_ids"] for c in by_copy] == [c["delta_token_ids"] for c in by_a1]
    assert http.post("/adapters/a1-copy/pin", json={"pinned": False}).json() == {
        "name": "a1-copy", "pinned": False}

    # Unregistering while a request uses the adapter is a conflict.
    running = {"prompt": "hello", "lora": "a1-copy", "request_id": "uses-copy",
               "params": {"max_tokens": 1000, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=running) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the connection
        assert json.loads(next(lines))["finished"] is False
        busy = _error(http.delete("/adapters/a1-copy"), 409)
        assert busy["type"] == "conflict_error" and "in use" in busy["message"]
        assert http.post("/abort", json={"request_id": "uses-copy"}).json() == {
            "aborted": True}
    _wait_idle(http)

    assert http.delete("/adapters/a1-copy").json() == {"name": "a1-copy",
                                                       "status": "unloaded"}
    assert {a["name"] for a in http.get("/adapters").json()} == {"a0", "a1"}
    gone = _error(http.post("/generate", json={**body, "lora": "a1-copy"}), 400)
    assert gone["message"] == "unknown adapter 'a1-copy'"
    missing = {"message": "unknown adapter 'nope'", "type": "not_found_error", "param": None,
               "code": None}
    assert _error(http.delete("/adapters/nope"), 404) == missing
    assert _error(http.post("/adapters/nope/pin", json={"pinned": True}), 404) == missing


def test_a_corrupt_adapter_is_refused_and_the_engine_keeps_serving(
        http: httpx.Client, adapters: dict[str, Path], tmp_path: Path) -> None:
    body = {"prompt": "hello world", "params": GREEDY, "lora": "a0"}
    before = _generate(http, body)["text"]
    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapters["a0"], corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    refused = _error(http.post("/adapters", json={"name": "broken", "path": str(corrupt)}),
                     400)
    assert (refused["type"], refused["param"]) == ("invalid_request_error", "path")
    assert refused["message"].startswith("adapter 'broken': adapter_model.safetensors is "
                                         "corrupt")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = _error(http.post("/adapters", json={"name": "broken", "path": str(empty)}),
                     400)
    assert "has no adapter_config.json" in refused["message"]
    assert _error(http.post("/adapters", json={"name": "", "path": str(empty)}),
                  400)["param"] == "name"

    assert http.get("/health").status_code == 200
    assert {a["name"] for a in http.get("/adapters").json()} == {"a0", "a1"}
    assert _generate(http, body)["text"] == before
    _wait_idle(http)


# ---------------------------------------------------------------------- health, metrics
def test_health_and_metrics(http: httpx.Client) -> None:
    health = http.get("/health")
    assert (health.status_code, health.json()) == (200, {"status": "ready", "in_flight": 0})

    prompt = _long_prompt(3)
    before = http.get("/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith(
        "text/plain")
    hits = _metric(before.text, "loragate_prefix_cache_hit_tokens_total")
    ttft_count = _metric(before.text, "loragate_time_to_first_token_seconds_count")
    body = {"prompt_token_ids": prompt, "params": {**GREEDY, "max_tokens": 2}}
    _generate(http, body)
    _generate(http, body)  # 12 full blocks cached by the first: 192 tokens hit
    after = http.get("/metrics").text
    assert _metric(after, "loragate_prefix_cache_hit_tokens_total") - hits == 192.0
    assert _metric(after, "loragate_time_to_first_token_seconds_count") - ttft_count == 2.0
    assert _metric(after, 'loragate_kv_pool_used_blocks{pool="base"}') == 0.0
    assert _metric(after, 'loragate_time_to_first_token_seconds_bucket{le="+Inf"}') == \
        _metric(after, "loragate_time_to_first_token_seconds_count")
    assert _metric(after, "loragate_kv_blocks_total") == float(NUM_KV_BLOCKS)
    assert _metric(after, "loragate_kv_blocks_used") == 0.0
    _wait_idle(http)
