"""LocalEngine, the engine in the gateway's process: the EngineClient protocol over a real
AsyncEngine (tiny model), adapter roots, and a fatal engine error that ends open streams at
once and is followed by a fresh engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.adapter_roots import AdapterRoots
from engine.config import EngineConfig
from engine.protocol import (
    EngineRejected,
    EngineStreamBroken,
    EngineUnavailable,
    GenerateRequest,
    StreamChunk,
)
from engine.sampling_params import SamplingParams
from gateway.local_engine import LocalEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture
def local(tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> Iterator[LocalEngine]:
    engine = LocalEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64),
                         AdapterRoots([tiny_adapters["a0"]]))
    yield engine
    engine.shutdown()


async def _run(local: LocalEngine, request_id: str, **extra: Any) -> list[StreamChunk]:
    stream = await local.open(GenerateRequest(request_id, [5, 6, 7, 8], GREEDY, **extra))
    return [chunk async for chunk in stream]


def test_requests_adapters_and_state_through_the_protocol(
        local: LocalEngine, tiny_adapters: dict[str, Path]) -> None:
    async def main() -> None:
        base = await _run(local, "base")
        assert [c.finish_reason for c in base] == [None] * 5 + ["length"]
        assert sum(len(c.delta_token_ids) for c in base) == 6
        loaded = await local.load_adapter("a0", str(tiny_adapters["a0"]))
        assert (loaded.name, loaded.rank) == ("a0", 8)
        with pytest.raises(EngineRejected, match="outside the engine's adapter roots") as exc:
            await local.load_adapter("a1", str(tiny_adapters["a1"]))
        assert (exc.value.status, exc.value.param) == (400, "path")
        tuned = await _run(local, "tuned", adapter="a0")
        assert [t for c in tuned for t in c.delta_token_ids] != \
            [t for c in base for t in c.delta_token_ids]
        await local.pin_adapter("a0", True)
        state = await local.state()
        assert (state.instance_id, state.in_flight, state.kv_blocks_used) == ("local", 0, 0)
        assert [(a.name, a.pinned) for a in state.adapters] == [("a0", True)]
        with pytest.raises(EngineRejected, match="unknown adapter 'nope'"):
            await local.unload_adapter("nope")
        with pytest.raises(EngineRejected, match="prompt is empty"):
            await local.open(GenerateRequest("empty", [], GREEDY))
        # A stream closed before it was read still ends its request.
        unread = await local.open(GenerateRequest("unread", [5, 6], SamplingParams(
            max_tokens=500, ignore_eos=True)))
        await unread.aclose()
        assert await local.abort("unread") is False
        assert (await local.state()).kv_blocks_used == 0

    asyncio.run(main())


def test_a_fatal_engine_error_breaks_open_streams_and_a_new_engine_takes_over(
        local: LocalEngine, tiny_adapters: dict[str, Path]) -> None:
    local._backoff_s = 0.01  # rebuild at once (the default waits a second first)

    def broken(*_: Any) -> Any:
        raise RuntimeError("injected: engine state lost")

    async def main() -> list[StreamChunk]:
        await local.load_adapter("a0", str(tiny_adapters["a0"]))
        stream = await local.open(GenerateRequest("doomed", [5, 6, 7], SamplingParams(
            max_tokens=500, ignore_eos=True)))
        await anext(stream)
        dying = local._engine
        dying.engine.step = broken  # type: ignore[method-assign]
        dying.engine.abort_request = broken  # type: ignore[method-assign, assignment]
        with pytest.raises(EngineStreamBroken):
            async for _ in stream:
                pass
        deadline = time.monotonic() + 60
        while True:  # unavailable while the new engine loads, then back
            try:
                state = await local.state()
                break
            except EngineUnavailable:
                assert time.monotonic() < deadline, "no new engine after 60 s"
                await asyncio.sleep(0.05)
        assert local._engine is not dying and local.restarts == 1
        assert state.adapters == []  # a new engine: the gateway registers adapters again
        return await _run(local, "after")

    after = asyncio.run(main())
    assert after[-1].finish_reason == "length"
