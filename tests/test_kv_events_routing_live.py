"""A gateway that follows its engine's KV events (--kv-events) instead of polling its sparse
prefix hashes: after a churny workload (evictions included) its prefix index holds exactly
as many blocks as the engine has cached, with polls too far apart to have told it, and it
joined after the engine had published (what came before, it replays from the engine's
buffer). Where a polling gateway routes on blocks the engine has evicted (stale routes, as
its metrics count them against each answer's cached tokens), one following events does
not."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from gateway.serve import free_port
from tests.live_http import instances, metric, wait_engines_idle
from tests.live_servers import LiveServer, running, start_engine, start_gateway

DEADLINE_S = 20.0


def _publishing_engine(model: Path, workdir: Path) -> LiveServer:
    """An engine of 24 blocks of 16 that publishes every block and its KV events."""
    events, replay = free_port(), free_port()
    return start_engine(model, workdir, "--num-kv-blocks", "24", "--block-size", "16",
                        "--prefix-publish-every", "1", "--kv-events-endpoint",
                        f"tcp://*:{events}", "--kv-events-replay-endpoint", f"tcp://*:{replay}")


def _engine_hashes(engine_url: str) -> int:
    # With --prefix-publish-every 1 the engine's full publish names every cached block.
    state = httpx.get(engine_url + "/state", params={"cursor": 0}, timeout=10.0).json()
    assert state["prefix"]["full"]
    return len(state["prefix"]["added"])


def _agree(gateway_url: str, engine_url: str) -> tuple[int, int]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        held = instances(gateway_url)[engine_url]["prefix_hashes"]
        cached = _engine_hashes(engine_url)
        if held == cached or time.monotonic() > deadline:
            return held, cached
        time.sleep(0.1)


def test_the_gateway_index_follows_the_engine_block_by_block(tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    engine = _publishing_engine(tiny_model_dir, tmp_path)
    rng = random.Random(3)
    docs = [[rng.randrange(5, 500) for _ in range(120)] for _ in range(6)]
    with running(engine):
        # Published before any gateway listens: the gateway must replay these.
        for doc in docs[:2]:
            httpx.post(engine.url + "/generate", timeout=30.0, json={
                "prompt_token_ids": doc, "stream": False, "params": {"max_tokens": 2}})
        # Polls 30 s apart: within the test only the events can keep the index current.
        gateway = start_gateway(tiny_model_dir, [engine.url], tmp_path, "--kv-events", "true",
                                "--poll-interval-s", "30")
        with running(gateway):
            assert _agree(gateway.url, engine.url)[0] > 0
            assert instances(gateway.url)[engine.url]["prefix_source"] == "kv_events"
            for i in range(24):  # 6 documents of 7 full blocks into 24 blocks: evictions
                doc = docs[i % 6] + [rng.randrange(5, 500) for _ in range(20)]
                answer = httpx.post(gateway.url + "/v1/completions", timeout=30.0, json={
                    "model": tiny_model_dir.name, "prompt": doc, "max_tokens": 3})
                assert answer.status_code == 200, answer.text
            wait_engines_idle(engine.url)
            held, cached = _agree(gateway.url, engine.url)
            assert held == cached and cached > 0
            metrics = httpx.get(engine.url + "/metrics", timeout=10.0).text
            evicted = [line for line in metrics.splitlines()
                       if line.startswith("loragate_prefix_cache_evictions_total")]
            assert evicted and float(evicted[0].split()[-1]) > 0


def _gateway_metric(gateway_url: str, name: str) -> float:
    return metric(httpx.get(gateway_url + "/metrics", timeout=10.0).text,
                  f"loragate_gateway_{name}_total")


def _serve(gateway_url: str, model: str, order: list[int], docs: list[list[int]],
           rng: random.Random, settle: Callable[[], object]) -> list[int]:
    """Each document of ``order`` with a fresh question, one at a time; the prompt tokens
    each answer's usage says came from the cache."""
    cached = []
    for i in order:
        answer = httpx.post(gateway_url + "/v1/completions", timeout=30.0, json={
            "model": model, "prompt": docs[i] + [rng.randrange(5, 500) for _ in range(20)],
            "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        cached.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        settle()
    return cached


def test_events_leave_no_stale_routes_where_polling_credits_evicted_blocks(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = _publishing_engine(tiny_model_dir, tmp_path)
    rng = random.Random(5)
    docs = [[rng.randrange(5, 500) for _ in range(120)] for _ in range(8)]
    # Each document twice in a row (the second read hits: 7 full blocks of 16), then
    # documents whose blocks three others have pushed out of the 24.
    order = [0, 0, 1, 1, 2, 2, 3, 3, 0, 1]
    with running(engine):
        polled = start_gateway(tiny_model_dir, [engine.url], tmp_path, "--poll-interval-s",
                               "30")
        with running(polled):
            cached = _serve(polled.url, tiny_model_dir.name, order, docs, rng,
                            lambda: wait_engines_idle(engine.url))
            assert cached[:8] == [0, 112] * 4 and cached[8:] == [0, 0]
            # Its index learns of evictions only by polling: the routed notes of documents
            # 0 and 1 still credit the engine with their blocks.
            assert _gateway_metric(polled.url, "stale_routes") == 2
            assert _gateway_metric(polled.url, "routed_prefix_found_tokens") == 4 * 112
        followed = start_gateway(tiny_model_dir, [engine.url], tmp_path, "--kv-events",
                                 "true", "--poll-interval-s", "30")
        with running(followed):
            _agree(followed.url, engine.url)
            cached = _serve(followed.url, tiny_model_dir.name, [4, 4, 5, 5, 6, 6, 7, 7, 4, 5],
                            docs, rng, lambda: _agree(followed.url, engine.url))
            assert cached[:8] == [0, 112] * 4 and cached[8:] == [0, 0]
            assert _gateway_metric(followed.url, "stale_routes") == 0
            credited = _gateway_metric(followed.url, "routed_prefix_credited_tokens")
            assert credited == _gateway_metric(followed.url, "routed_prefix_found_tokens")
            assert credited == 4 * 112
