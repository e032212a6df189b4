"""Routing through a live gateway over two live engine instances (real processes).

Each engine has 2 adapter slots (--max-loras 2) and 8 sequence slots; the gateway registers 6
adapters on both and routes with imbalance 0.3, so that one in-flight request (1/8 of the
load) is visible against the threshold: up to 2 extra requests on an instance keep prefix
affinity (gap 0.25 plus a little KV), 3 extra lose it (gap 0.375).

Prompts are token id lists, so prefixes and block hashes are exact. Every check reads the
gateway's x-loragate-route header (--debug-headers) and its /instances view.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.demo_model import make_peft_adapter
from gateway.exposure import instance_tag
from prefix_cache.hashing import chain_hashes, sparse_chain
from tests.live_http import (
    engine_state,
    instances,
    metric,
    poll,
    route_reason,
    route_scores,
    served_by,
    sse_events,
    wait_engines_idle,
)
from tests.live_servers import LiveServer, start_engine, start_gateway

MODEL = "tiny"
ADAPTERS = [f"ad{i}" for i in range(6)]
ENGINE_FLAGS = ("--num-kv-blocks", "1024", "--max-num-seqs", "8", "--max-loras", "2",
                "--max-lora-rank", "8")
PREFIX_LEN = 256  # 16 blocks of 16 tokens; hashes of blocks 3, 7, 11, 15 are published


@dataclass
class Cluster:
    gateway: LiveServer
    engines: list[LiveServer]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def other(self, url: str) -> str:
        (rest,) = [u for u in self.urls if u != url]
        return rest


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("routing-adapters")
    return {name: make_peft_adapter(tiny_model_dir, root / name, rank=8,
                                    target_modules=("q_proj", "v_proj"), seed=300 + i,
                                    b_scale=0.5)
            for i, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, adapters: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("routing-logs")
    roots = ("--adapter-root", str(next(iter(adapters.values())).parent))
    engines = [start_engine(tiny_model_dir, logs, *ENGINE_FLAGS, *roots) for _ in range(2)]
    gateway = start_gateway(tiny_model_dir, [e.url for e in engines], logs, "--imbalance",
                            "0.3", "--served-model-name", MODEL, "--debug-headers", "true",
                            adapters=adapters)
    try:
        for server in (*engines, gateway):
            server.wait_ready()
        poll(lambda: all(i["healthy"] and sorted(i["adapters"]) == ADAPTERS
                         for i in instances(gateway.url).values()),
             "both instances healthy with the 6 adapters registered")
        yield Cluster(gateway, engines)
    finally:
        for server in (gateway, *engines):
            server.stop()


def wait_quiet(cluster: Cluster) -> None:
    """Engines idle, and the gateway's view of them caught up (no stale load or KV use)."""
    wait_engines_idle(*cluster.urls)
    poll(lambda: all((i["in_flight"], i["num_running"], i["kv_usage"]) == (0, 0, 0.0)
                     for i in instances(cluster.gateway.url).values()),
         "the gateway to see both instances idle")


def completion_body(prompt: list[int], model: str = MODEL, max_tokens: int = 1,
                    **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}


def complete(cluster: Cluster, prompt: list[int], model: str = MODEL, max_tokens: int = 1
             ) -> httpx.Response:
    response = httpx.post(cluster.gateway.url + "/v1/completions",
                          json=completion_body(prompt, model, max_tokens), timeout=60.0)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_tokens
    return response


def random_tokens(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(3, 500), k=n)


def publish_prefix(cluster: Cluster, prefix: list[int]) -> str:
    """Serve `prefix` once through the gateway; return the instance that took it, once the
    gateway's prefix index holds every hash that instance published for it."""
    response = complete(cluster, [*prefix, 1])
    holder = served_by(response)
    assert response.headers["x-loragate-instance"] == instance_tag(holder)  # opaque
    first = engine_state(holder)
    wanted = {format(h, "x") for _, h in sparse_chain(
        chain_hashes(prefix, first["block_size"]), first["publish_every"])}
    assert len(wanted) == PREFIX_LEN // first["block_size"] // first["publish_every"]

    def published() -> int | None:
        state = engine_state(holder)
        return int(state["prefix"]["cursor"]) if wanted <= set(state["prefix"]["added"]) else None

    cursor = poll(published, f"{holder} to publish the prefix hashes")
    poll(lambda: instances(cluster.gateway.url)[holder]["prefix_cursor"] >= cursor,
         f"the gateway to apply {holder}'s prefix updates up to cursor {cursor}")
    return holder


# ------------------------------------------------------------------------------ adapters
def test_gateway_registers_every_adapter_on_both_instances(cluster: Cluster) -> None:
    view = instances(cluster.gateway.url)
    assert sorted(view) == sorted(cluster.urls)
    digests = [{name: a["digest"] for name, a in i["adapters"].items()} for i in view.values()]
    assert digests[0] == digests[1]
    assert len(set(digests[0].values())) == len(ADAPTERS)
    models = httpx.get(cluster.gateway.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, *ADAPTERS]


def test_adapter_requests_go_to_the_instance_where_it_is_resident(cluster: Cluster) -> None:
    wait_quiet(cluster)
    a, b = cluster.urls
    # Make ad0, ad1 resident on A and ad2, ad3 on B by serving them there directly (2 slots
    # each, least recently used adapter evicted).
    for url, names in ((a, ("ad0", "ad1")), (b, ("ad2", "ad3"))):
        for name in names:
            response = httpx.post(url + "/generate", json={
                "prompt_token_ids": [7, 8, 9], "params": {"max_tokens": 1}, "lora": name,
                "stream": False}, timeout=60.0)
            assert response.status_code == 200, response.text
    expected = {a: ["ad0", "ad1"], b: ["ad2", "ad3"]}
    poll(lambda: {k: i["resident"] for k, i in instances(cluster.gateway.url).items()}
         == expected, f"the gateway to see residency {expected}")

    for name, home in (("ad0", a), ("ad2", b), ("ad1", a), ("ad3", b), ("ad0", a)):
        response = complete(cluster, [10, 11, 12, 13], model=name)
        assert (served_by(response), route_reason(response)) == (
            home, "adapter_resident"), response.headers["x-loragate-route"]

    # ad4 is resident nowhere and both instances' slots hold idle adapters: it goes to one of
    # them, becomes resident there, and sticks.
    first = complete(cluster, [10, 11, 12, 13], model="ad4")
    chosen = served_by(first)
    assert route_reason(first) == "least_loaded"
    poll(lambda: "ad4" in instances(cluster.gateway.url)[chosen]["resident"],
         f"ad4 to be resident on {chosen}")
    assert "ad4" not in instances(cluster.gateway.url)[cluster.other(chosen)]["resident"]
    again = complete(cluster, [14, 15, 16], model="ad4")
    assert (served_by(again), route_reason(again)) == (
        chosen, "adapter_resident")


# -------------------------------------------------------------------------------- prefix
def test_prefix_sharing_burst_lands_on_the_instance_holding_the_prefix(cluster: Cluster
                                                                      ) -> None:
    wait_quiet(cluster)
    prefix = random_tokens(1, PREFIX_LEN)
    holder = publish_prefix(cluster, prefix)
    hits_before = metric(httpx.get(holder + "/metrics").text,
                         "loragate_prefix_cache_hit_tokens_total")

    def send(suffix: int) -> httpx.Response:
        return complete(cluster, [*prefix, suffix, suffix + 1], max_tokens=16)

    with ThreadPoolExecutor(3) as pool:
        burst = list(pool.map(send, (20, 30, 40)))
    assert [(served_by(r), route_reason(r)) for r in burst] == [
        (holder, "prefix")] * 3
    assert all(" matched=256 " in r.headers["x-loragate-route"] for r in burst)
    hits_after = metric(httpx.get(holder + "/metrics").text,
                        "loragate_prefix_cache_hit_tokens_total")
    assert hits_after - hits_before == 3 * PREFIX_LEN


def test_overloaded_prefix_holder_sheds_to_the_other_instance(cluster: Cluster) -> None:
    wait_quiet(cluster)
    prefix = random_tokens(2, PREFIX_LEN)
    holder = publish_prefix(cluster, prefix)
    other = cluster.other(holder)
    url = cluster.gateway.url + "/v1/completions"
    held: list[Iterator[Any]] = []
    with httpx.Client(timeout=60.0) as client, contextlib.ExitStack() as streams:
        # Three long streams with the prefix: affinity keeps them on the holder (load gaps
        # 0, 0.125, 0.25 are within the imbalance of 0.3).
        for i in range(3):
            response = streams.enter_context(client.stream(
                "POST", url, json=completion_body([*prefix, 50 + i], max_tokens=700,
                                                  stream=True)))
            assert response.status_code == 200
            assert (served_by(response), route_reason(response)) == (
                holder, "prefix"), response.headers["x-loragate-route"]
            events = sse_events(response)
            assert next(events)["choices"][0]["finish_reason"] is None
            held.append(events)  # dropping a half-read iterator would close the stream
        # A fourth request with the same prefix: the holder is 3/8 more loaded, beyond the
        # imbalance, so its prefix credit is dropped and the idle instance wins.
        probe = complete(cluster, [*prefix, 60])
        assert (served_by(probe), route_reason(probe)) == (
            other, "least_loaded"), probe.headers["x-loragate-route"]
        assert " matched=0 " in probe.headers["x-loragate-route"]
        scores = route_scores(probe)
        assert scores[holder] <= 3.0 - 3 / 8  # tier 3, no prefix credit, load >= 3/8
        assert instances(cluster.gateway.url)[holder]["in_flight"] == 3, (
            "the long streams ended before the probe was routed")
    wait_quiet(cluster)


def test_a_burst_on_a_new_prefix_stays_together(cluster: Cluster) -> None:
    """No engine has published the prefix yet: the gateway's notes of what it just routed
    keep the burst on one instance, where the document is computed once."""
    wait_quiet(cluster)
    prefix = random_tokens(3, PREFIX_LEN)
    hits_before = {url: metric(httpx.get(url + "/metrics").text,
                               "loragate_prefix_cache_hit_tokens_total") for url in cluster.urls}

    def send(suffix: int) -> httpx.Response:
        return complete(cluster, [*prefix, suffix, suffix + 1], max_tokens=16)

    with ThreadPoolExecutor(3) as pool:
        burst = list(pool.map(send, (20, 30, 40)))
    assert len({served_by(r) for r in burst}) == 1, [
        r.headers["x-loragate-route"] for r in burst]
    followers = [r for r in burst if route_reason(r) == "prefix"]
    assert len(followers) == 2, [r.headers["x-loragate-route"] for r in burst]
    assert all(" matched=256 " in r.headers["x-loragate-route"] for r in followers)
    hits = sum(metric(httpx.get(url + "/metrics").text, "loragate_prefix_cache_hit_tokens_total")
               - hits_before[url] for url in cluster.urls)
    assert hits == 2 * PREFIX_LEN


def test_a_prompt_cache_key_returns_to_the_instance_it_last_went_to(cluster: Cluster) -> None:
    """Requests that share a prompt_cache_key but no cached block are routed for the key
    (the router's own scoring of it: tests/test_router.py); a key counts only among
    requests that can share cache blocks (the same cache_salt here)."""
    wait_quiet(cluster)
    first = served_by(complete_keyed(cluster, random_tokens(50, 8), "conv-1"))
    again = complete_keyed(cluster, random_tokens(51, 8), "conv-1")  # no shared block
    assert (served_by(again), route_reason(again)) == (first, "prompt_cache_key")
    salted = complete_keyed(cluster, random_tokens(52, 8), "conv-1", cache_salt="other")
    assert route_reason(salted) == "least_loaded"


def complete_keyed(cluster: Cluster, prompt: list[int], key: str, **extra: Any
                   ) -> httpx.Response:
    response = httpx.post(cluster.gateway.url + "/v1/completions", timeout=60.0,
                          json=completion_body(prompt, prompt_cache_key=key, **extra))
    assert response.status_code == 200, response.text
    return response
