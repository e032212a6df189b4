"""Constants of the package's live engine and helpers to call its API."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx

NUM_KV_BLOCKS = 64
BLOCK_SIZE = 16
CONTEXT = 1024  # the tiny model's max_position_embeddings
PUBLISH_EVERY = 4
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
DEADLINE_S = 20.0



def post_generate_stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in response.iter_lines() if line]


def post_generate(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post("/generate", json={**body, "stream": False})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def get_state(http: httpx.Client, cursor: int = 0) -> dict[str, Any]:
    response = http.get("/state", params={"cursor": cursor})
    assert response.status_code == 200
    state: dict[str, Any] = response.json()
    return state


def wait_idle(http: httpx.Client) -> dict[str, Any]:
    """Poll /state until no request runs or waits and no KV block is referenced."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        state = get_state(http)
        if (state["num_running"], state["num_waiting"], state["kv_blocks_used"],
                state["in_flight"]) == (0, 0, 0, 0):
            return state
        assert time.monotonic() < deadline, f"engine not idle: {state}"
        time.sleep(0.02)


def metric_value(text: str, series: str) -> float:
    """The value of one exposition line, e.g. 'loragate_kv_pool_used_blocks{pool="base"}'."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.rsplit(" ", 1)[0] == series]
    assert len(values) == 1, f"{series} appears {len(values)} times"
    return values[0]


def long_prompt(seed: int, length: int = 200) -> list[int]:
    """A prompt no other test sends (ids past the tokenizer's special tokens 0-4)."""
    rng = random.Random(seed)
    return [rng.randrange(5, 512) for _ in range(length)]


def error_body(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]
