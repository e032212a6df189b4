"""Reliability under load, disconnects and hostile input, against live processes (bounded in
time; the long versions are benchmarks/reliability.py).

- overload: far more concurrent requests than the admission bound -> every request ends in a
  completion or a 429 with Retry-After, none hangs or is lost, and the engine ends idle;
- disconnect storm: streams dropped at random points -> no leaked KV block or adapter slot;
- hostile input: invalid UTF-8, deeply nested JSON, NaN, huge stop lists, null bytes,
  oversized prompts -> 4xx in OpenAI's schema, never a 5xx, and the server stays healthy.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.demo_model import make_peft_adapter
from tests.live_http import engine_state, wait_engines_idle
from tests.live_servers import LiveServer, running, start_engine, start_gateway

MAX_IN_FLIGHT = 4


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[LiveServer, LiveServer]]:
    root = tmp_path_factory.mktemp("reliability")
    adapters = {"r0": make_peft_adapter(tiny_model_dir, root / "r0", rank=4,
                                        target_modules=("q_proj", "v_proj"), seed=5)}
    engine = start_engine(tiny_model_dir, root, "--num-kv-blocks", "128", "--max-num-seqs",
                          "8", adapters=adapters)
    gateway = start_gateway(tiny_model_dir, [engine.url], root, "--max-in-flight-per-instance",
                            str(MAX_IN_FLIGHT), adapters=adapters)
    with running(engine, gateway):
        yield engine, gateway


def _healthy(gateway: LiveServer) -> None:
    assert httpx.get(gateway.url + "/health", timeout=10.0).status_code == 200


def test_overload_ends_every_request_in_a_completion_or_a_429(
        servers: tuple[LiveServer, LiveServer]) -> None:
    engine, gateway = servers
    base = engine_state(engine.url)["model"]

    async def one(client: httpx.AsyncClient, i: int) -> int:
        response = await client.post("/v1/completions", json={
            "model": "r0" if i % 2 else base, "prompt": [5 + i % 50] * 40,
            "max_tokens": 24, "ignore_eos": True, "temperature": 0})
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["code"] == "overloaded"
        else:
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 24
        return response.status_code

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120.0) as client:
            return list(await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(60))), timeout=120))

    statuses = asyncio.run(burst())
    assert len(statuses) == 60  # nothing lost, nothing hung (wait_for would have raised)
    assert statuses.count(200) >= MAX_IN_FLIGHT and statuses.count(429) >= 1
    assert set(statuses) <= {200, 429}
    wait_engines_idle(engine.url)
    _healthy(gateway)


def test_disconnect_storm_leaks_no_block_or_slot(servers: tuple[LiveServer, LiveServer]
                                                 ) -> None:
    engine, gateway = servers
    rng = random.Random(0)

    async def drop(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": "r0" if i % 2 else engine_state(engine.url)["model"],
                "prompt": [7 + i % 30] * rng.randint(20, 200), "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        stop_after = rng.randint(0, 6)  # 0: before the first token
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                assert response.status_code == 429
                return
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= stop_after:
                    break  # leaving the block closes the connection mid-stream

    async def storm() -> None:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60.0) as client:
            for wave in range(5):
                await asyncio.gather(*(drop(client, wave * 20 + i) for i in range(20)))

    asyncio.run(storm())
    wait_engines_idle(engine.url)
    state = engine_state(engine.url)
    assert [a["running_requests"] for a in state["adapters"]] == [0]
    _healthy(gateway)


HOSTILE_BODIES: list[tuple[str, bytes, int]] = [
    ("invalid utf-8", b'{"model": "x", "prompt": "\xff\xfe\xfa"}', 400),
    ("deep json", b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("nan temperature", b'{"model": "M", "prompt": "hi", "temperature": NaN}', 400),
    ("huge stop list", json.dumps({"model": "M", "prompt": "hi",
                                   "stop": ["s"] * 10_000}).encode(), 400),
    ("huge stop string", json.dumps({"model": "M", "prompt": "hi",
                                     "stop": ["s" * 100_000]}).encode(), 400),
    ("null bytes", json.dumps({"model": "M", "prompt": "a\u0000b", "max_tokens": 2}).encode(),
     200),
    ("token id out of range", json.dumps({"model": "M", "prompt": [10**12]}).encode(), 400),
    ("negative token id", json.dumps({"model": "M", "prompt": [-1, 2]}).encode(), 400),
    ("prompt over the context", json.dumps({"model": "M", "prompt": [5] * 5000}).encode(), 400),
    ("huge prompt body", json.dumps({"model": "M", "prompt": [5] * 3_000_000}).encode(), 413),
    ("messages not a list", b'{"model": "M", "messages": {"role": "user"}}', 400),
    ("array body", b"[1, 2, 3]", 400),
    ("empty body", b"", 400),
]


@pytest.mark.parametrize(("case", "body", "status"), HOSTILE_BODIES,
                         ids=[c[0] for c in HOSTILE_BODIES])
def test_hostile_input_gets_a_4xx_and_the_server_stays_up(
        servers: tuple[LiveServer, LiveServer], case: str, body: bytes, status: int) -> None:
    engine, gateway = servers
    model = engine_state(engine.url)["model"]
    body = body.replace(b'"M"', json.dumps(model).encode())
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    response = httpx.post(gateway.url + path, content=body, timeout=60.0,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status, (case, response.text[:300])
    if status >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]
    _healthy(gateway)
