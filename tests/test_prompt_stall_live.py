"""A huge prompt must not freeze the gateway: while one is tokenized, another client's stream
keeps flowing. Live engine + gateway over a tiny model with a 512k-token context, so a
6 MB prompt passes the character cap (context x 16) and really is tokenized (then refused
as too long: it never reaches the engine).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from engine.demo_model import make_demo_model
from engine.demo_shapes import DemoModelSpec
from tests.live_http import engine_state, sse_events, wait_engines_idle
from tests.live_servers import LiveServer, running, start_engine, start_gateway

LONG_CONTEXT = 2**19
BIG_PROMPT = "lorem ipsum dolor sit amet " * 222_222  # 6 MB, about 4M tokens
STALL_BOUND_S = 2.0
"""Generous: the victim's chunks normally come every few ms; tokenizing BIG_PROMPT on the
event loop stalls them for seconds."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer]]:
    root = tmp_path_factory.mktemp("stall")
    model = make_demo_model(root / "long-context", DemoModelSpec(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, max_position_embeddings=LONG_CONTEXT, seed=0))
    engine = start_engine(model, root, "--num-kv-blocks", "1024")
    gateway = start_gateway(model, [engine.url], root)
    with running(engine, gateway):
        yield engine, gateway


def _model(gateway: LiveServer) -> str:
    return str(httpx.get(gateway.url + "/v1/models", timeout=10.0).json()["data"][0]["id"])


def test_a_huge_prompt_does_not_stall_another_stream(servers: tuple[LiveServer, LiveServer]
                                                     ) -> None:
    engine, gateway = servers
    model = _model(gateway)
    big: dict[str, httpx.Response] = {}

    def send_big() -> None:
        big["response"] = httpx.post(gateway.url + "/v1/completions", timeout=120.0, json={
            "model": model, "prompt": BIG_PROMPT, "max_tokens": 4})

    victim = {"model": model, "prompt": "The quick brown fox", "max_tokens": 12000,
              "ignore_eos": True, "stream": True}
    gaps: list[float] = []
    with httpx.stream("POST", gateway.url + "/v1/completions", json=victim,
                      timeout=120.0) as response:
        assert response.status_code == 200
        events = sse_events(response)
        assert "choices" in next(events)
        sender = threading.Thread(target=send_big)
        sender.start()
        last = time.monotonic()
        for event in events:  # until the huge prompt has its answer
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            assert event != "[DONE]", "the victim ended before the huge prompt was answered"
            assert "error" not in event, event
            if not sender.is_alive():
                break
        sender.join()
    print(f"victim's longest gap while a {len(BIG_PROMPT)}-character prompt was tokenized: "
          f"{max(gaps):.3f} s over {len(gaps)} chunks")
    error = big["response"].json()["error"]
    assert (big["response"].status_code, error["code"], error["param"]) == (
        400, "context_length_exceeded", "prompt")
    assert error["message"].startswith(f"This model's maximum context length is "
                                       f"{LONG_CONTEXT} tokens; the prompt has ")
    assert max(gaps) < STALL_BOUND_S
    wait_engines_idle(engine.url)


def test_what_the_kv_cache_holds_bounds_a_request_below_the_context(
        servers: tuple[LiveServer, LiveServer]) -> None:
    # 1024 blocks hold far less than the 512k context: a max_tokens past what they leave
    # after the prompt is lowered to it (as past the context's end), a prompt that leaves
    # nothing is refused.
    engine, gateway = servers
    room = engine_state(engine.url)["max_request_tokens"]
    assert 0 < room < LONG_CONTEXT
    url, model = gateway.url + "/v1/completions", _model(gateway)
    answer = httpx.post(url, timeout=120.0, json={
        "model": model, "prompt": [5] * (room - 3), "max_tokens": 100, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["usage"]["completion_tokens"],
            answer.json()["choices"][0]["finish_reason"]) == (3, "length")
    refused = httpx.post(url, timeout=120.0, json={
        "model": model, "prompt": [5] * room, "max_tokens": 1})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        f"the prompt ({room} tokens) leaves no room for output in what one request can hold "
        f"in the engines' KV cache ({room} tokens): shorten the prompt")
    wait_engines_idle(engine.url)
