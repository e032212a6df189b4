"""The engine's own HTTP API (engine/http/server.py): state, published prefixes, adapters,
health and metrics.

Against the package's live engine (conftest.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx

from prefix_cache.hashing import chain_hashes, sparse_chain
from tests.engine_server.helpers import (
    BLOCK_SIZE,
    CONTEXT,
    GREEDY,
    NUM_KV_BLOCKS,
    PUBLISH_EVERY,
    error_body,
    get_state,
    long_prompt,
    metric_value,
    post_generate,
    post_generate_stream,
    wait_idle,
)

STATE_FIELDS = {
    "instance_id", "model", "draining", "in_flight", "num_running", "num_waiting",
    "num_swapped", "kv_blocks_used", "kv_blocks_total", "max_loras", "max_lora_rank",
    "max_num_seqs",
    "block_size", "publish_every", "max_model_len", "max_request_tokens", "prefix_hit_rate",
    "kv_pools", "adapters", "prefix", "kv_events", "sampling_defaults",
}
ADAPTER_FIELDS = {"name", "path", "digest", "rank", "in_cpu", "slot", "pinned",
                  "running_requests"}


# ----------------------------------------------------------------------- state, prefix
def test_state_reports_config_load_and_adapters(http: httpx.Client,
                                                adapters: dict[str, Path]) -> None:
    state = wait_idle(http)
    assert set(state) == STATE_FIELDS
    assert (state["instance_id"], state["draining"], state["num_swapped"],
            state["kv_blocks_total"], state["block_size"], state["publish_every"],
            state["max_model_len"], state["max_loras"], state["max_request_tokens"],
            state["max_lora_rank"]) == (
        "engine-under-test", False, 0, NUM_KV_BLOCKS, BLOCK_SIZE, PUBLISH_EVERY, CONTEXT, 4,
        min(CONTEXT, NUM_KV_BLOCKS * BLOCK_SIZE), 16)
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
    # Something published first: cursor 0 asks for a full snapshot, not an update.
    post_generate(http, {"prompt_token_ids": long_prompt(4),
                         "params": {**GREEDY, "max_tokens": 2}})
    cursor = get_state(http)["prefix"]["cursor"]
    assert cursor > 0
    prompt = long_prompt(2)  # 12 full blocks: the 4th, 8th and 12th are published
    post_generate(http, {"prompt_token_ids": prompt, "params": {**GREEDY, "max_tokens": 2}})
    update = get_state(http, cursor)["prefix"]
    expected = {format(h, "x") for _, h in
                sparse_chain(chain_hashes(prompt, BLOCK_SIZE), PUBLISH_EVERY)}
    assert len(expected) == 3
    assert update["full"] is False
    assert set(update["added"]) == expected
    assert update["cursor"] == cursor + len(update["added"]) + len(update["removed"])
    assert all(int(h, 16) >= 0 for h in update["added"] + update["removed"])
    # Nothing new since the new cursor; a full snapshot (cursor 0) holds the hashes too.
    assert get_state(http, update["cursor"])["prefix"] == {
        "cursor": update["cursor"], "full": False, "added": [], "removed": []}
    snapshot = get_state(http, 0)["prefix"]
    assert snapshot["full"] is True and expected <= set(snapshot["added"])
    wait_idle(http)


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
    by_copy = post_generate_stream(http, {**body, "lora": "a1-copy"})
    by_a1 = post_generate_stream(http, {**body, "lora": "a1"})
    assert [c["delta_token_ids"] for c in by_copy] == [c["delta_token_ids"] for c in by_a1]
    assert http.post("/adapters/a1-copy/pin", json={"pinned": False}).json() == {
        "name": "a1-copy", "pinned": False}

    # Unregistering while a request uses the adapter is a conflict.
    running = {"prompt": "hello", "lora": "a1-copy", "request_id": "uses-copy",
               "params": {"max_tokens": 1000, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=running) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the connection
        assert json.loads(next(lines))["finished"] is False
        busy = error_body(http.delete("/adapters/a1-copy"), 409)
        assert busy["type"] == "conflict_error" and "in use" in busy["message"]
        assert http.post("/abort", json={"request_id": "uses-copy"}).json() == {
            "aborted": True}
    wait_idle(http)

    assert http.delete("/adapters/a1-copy").json() == {"name": "a1-copy",
                                                       "status": "unloaded"}
    assert {a["name"] for a in http.get("/adapters").json()} == {"a0", "a1"}
    gone = error_body(http.post("/generate", json={**body, "lora": "a1-copy"}), 400)
    assert gone["message"] == "unknown adapter 'a1-copy'"
    missing = {"message": "unknown adapter 'nope'", "type": "invalid_request_error", "param": None,
               "code": None}
    assert error_body(http.delete("/adapters/nope"), 404) == missing
    assert error_body(http.post("/adapters/nope/pin", json={"pinned": True}), 404) == missing


def test_an_unloaded_adapters_series_leave_the_metrics(http: httpx.Client,
                                                        adapters: dict[str, Path]) -> None:
    """Per-pool and per-adapter series go with the adapter; the global counters keep what
    its requests counted (they never go down)."""
    assert http.post("/adapters", json={"name": "metered", "path": str(adapters["a0"])}
                     ).status_code == 200
    post_generate(http, {"prompt_token_ids": long_prompt(7), "lora": "metered",
                         "params": {**GREEDY, "max_tokens": 2}})
    wait_idle(http)
    during = http.get("/metrics").text
    assert metric_value(during, 'loragate_kv_pool_cached_blocks{pool="metered"}') > 0
    assert metric_value(during, 'loragate_kv_pool_used_blocks{pool="metered"}') == 0.0
    assert metric_value(during, 'loragate_lora_resident{adapter="metered"}') == 1.0
    queried = metric_value(during, "loragate_prefix_cache_query_tokens_total")
    assert http.delete("/adapters/metered").status_code == 200
    after = http.get("/metrics").text
    assert 'pool="metered"' not in after and '"metered"' not in after, [
        line for line in after.splitlines() if "metered" in line]
    assert metric_value(after, "loragate_prefix_cache_query_tokens_total") == queried
    assert metric_value(after, 'loragate_kv_pool_used_blocks{pool="base"}') == 0.0
    wait_idle(http)


def test_same_name_other_content_replaces_only_an_idle_adapter(
        http: httpx.Client, adapters: dict[str, Path]) -> None:
    body = {"prompt": "hello world", "params": GREEDY}
    want = [c["delta_token_ids"] for c in post_generate_stream(http, {**body, "lora": "a0"})]
    assert http.post("/adapters", json={"name": "swap", "path": str(adapters["a1"])}
                     ).status_code == 200
    running = {"prompt": "hello", "lora": "swap", "request_id": "uses-swap",
               "params": {"max_tokens": 1000, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=running) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the connection
        assert json.loads(next(lines))["finished"] is False
        busy = error_body(http.post("/adapters", json={"name": "swap",
                                                       "path": str(adapters["a0"])}), 409)
        assert busy["code"] == "adapter_in_use" and "in use" in busy["message"]
        assert http.post("/abort", json={"request_id": "uses-swap"}).json() == {
            "aborted": True}
    wait_idle(http)
    replaced = http.post("/adapters", json={"name": "swap", "path": str(adapters["a0"])})
    a0 = {a["name"]: a for a in http.get("/adapters").json()}["a0"]
    assert replaced.json()["digest"] == a0["digest"]
    got = [c["delta_token_ids"] for c in post_generate_stream(http, {**body, "lora": "swap"})]
    assert got == want  # the new content, never the old weights kept in a slot
    assert http.delete("/adapters/swap").status_code == 200
    wait_idle(http)


def test_requests_and_unloads_naming_weights_touch_only_those_weights(
        http: httpx.Client, adapters: dict[str, Path]) -> None:
    """A request's lora_digest is the weights it means: under that name the engine holds
    other weights (or none), so it is refused with "adapter_changed" and nothing runs. An
    unload naming weights leaves other weights of that name registered (404)."""
    digests = {a["name"]: a["digest"] for a in http.get("/adapters").json()}
    body = {"prompt": "hello world", "params": GREEDY}
    want = post_generate(http, {**body, "lora": "a1"})["text"]
    assert http.post("/adapters", json={"name": "held", "path": str(adapters["a1"])}
                     ).status_code == 200
    for digest in (digests["a0"], "0" * 32):
        refused = error_body(http.post("/generate", json={
            **body, "lora": "held", "lora_digest": digest, "stream": False}), 409)
        assert (refused["code"], refused["type"]) == ("adapter_changed", "conflict_error")
    gone = error_body(http.post("/generate", json={
        **body, "lora": "absent", "lora_digest": digests["a0"], "stream": False}), 409)
    assert gone["code"] == "adapter_changed"
    assert post_generate(http, {**body, "lora": "held", "lora_digest": digests["a1"]}
                         )["text"] == want
    other = error_body(http.delete("/adapters/held", params={"digest": digests["a0"]}), 404)
    assert "other weights" in other["message"]
    assert post_generate(http, {**body, "lora": "held"})["text"] == want
    assert http.delete("/adapters/held", params={"digest": digests["a1"]}).status_code == 200
    assert "held" not in {a["name"] for a in http.get("/adapters").json()}
    assert get_state(http)["num_waiting"] == 0
    wait_idle(http)


def test_a_corrupt_adapter_is_refused_and_the_engine_keeps_serving(
        http: httpx.Client, adapters: dict[str, Path], adapter_root: Path) -> None:
    body = {"prompt": "hello world", "params": GREEDY, "lora": "a0"}
    before = post_generate(http, body)["text"]
    corrupt = adapter_root / "corrupt"
    shutil.copytree(adapters["a0"], corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    refused = error_body(http.post("/adapters", json={"name": "broken", "path": str(corrupt)}),
                         400)
    assert (refused["type"], refused["param"]) == ("invalid_request_error", "path")
    assert refused["message"].startswith("adapter 'broken': adapter_model.safetensors is "
                                         "corrupt")
    empty = adapter_root / "empty"
    empty.mkdir()
    refused = error_body(http.post("/adapters", json={"name": "broken", "path": str(empty)}),
                         400)
    assert "has no adapter_config.json" in refused["message"]
    assert error_body(http.post("/adapters", json={"name": "", "path": str(empty)}),
                      400)["param"] == "name"

    assert http.get("/health").status_code == 200
    assert {a["name"] for a in http.get("/adapters").json()} == {"a0", "a1"}
    assert post_generate(http, body)["text"] == before
    wait_idle(http)


# ---------------------------------------------------------------------- health, metrics
def test_health_and_metrics(http: httpx.Client) -> None:
    health = http.get("/health")
    assert (health.status_code, health.json()) == (200, {"status": "ready", "in_flight": 0})

    prompt = long_prompt(3)
    before = http.get("/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith(
        "text/plain")
    hits = metric_value(before.text, "loragate_prefix_cache_hit_tokens_total")
    ttft_count = metric_value(before.text, "loragate_time_to_first_token_seconds_count")
    body = {"prompt_token_ids": prompt, "params": {**GREEDY, "max_tokens": 2}}
    post_generate(http, body)
    post_generate(http, body)  # 12 full blocks cached by the first: 192 tokens hit
    after = http.get("/metrics").text
    assert metric_value(after, "loragate_prefix_cache_hit_tokens_total") - hits == 192.0
    assert metric_value(after, "loragate_time_to_first_token_seconds_count") - ttft_count == 2.0
    assert metric_value(after, 'loragate_kv_pool_used_blocks{pool="base"}') == 0.0
    assert metric_value(after, 'loragate_time_to_first_token_seconds_bucket{le="+Inf"}') == \
        metric_value(after, "loragate_time_to_first_token_seconds_count")
    assert metric_value(after, "loragate_kv_blocks_total") == float(NUM_KV_BLOCKS)
    assert metric_value(after, "loragate_kv_blocks_used") == 0.0
    wait_idle(http)

