"""AsyncEngine: concurrent streams, abort on close, errors, stats from the engine thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_thread import EngineDeadError
from engine.llm_engine import LLMEngine
from engine.protocol import GenerateRequest
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def async_engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_model_dir), num_kv_blocks=64, max_num_batched_tokens=64))
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams,
                   request_id: str | None = None) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_concurrent_streams_match_sequential(async_engine: AsyncEngine) -> None:
    prompts = [list(range(5 + i, 40 + 9 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    async def main() -> tuple[list[list[int]], list[list[int]]]:
        together = await asyncio.gather(*(_collect(async_engine, p, params) for p in prompts))
        alone = [await _collect(async_engine, p, params) for p in prompts]
        return ([o[-1].token_ids for o in together], [o[-1].token_ids for o in alone])

    together, alone = asyncio.run(main())
    assert together == alone
    assert all(len(t) == 10 for t in together)


def test_stream_yields_incrementally_and_finishes(async_engine: AsyncEngine) -> None:
    async def main() -> list[RequestOutput]:
        return await _collect(async_engine, [7, 8, 9], SamplingParams(
            max_tokens=5, temperature=0, ignore_eos=True))

    outs = asyncio.run(main())
    assert [len(o.delta_token_ids) for o in outs] == [1] * 5
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert outs[-1].finish_reason == "length"


def test_closing_the_stream_aborts_and_frees_blocks(async_engine: AsyncEngine) -> None:
    async def main() -> None:
        stream = async_engine.generate(list(range(5, 100)), SamplingParams(
            max_tokens=200, temperature=0, ignore_eos=True), request_id="leaver")
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        stats = await async_engine.fresh_stats()
        assert stats.kv_blocks_used == 0
        assert stats.num_running == stats.num_waiting == 0

    asyncio.run(main())


def test_explicit_abort_ends_stream_with_abort(async_engine: AsyncEngine) -> None:
    async def main() -> RequestOutput:
        last: RequestOutput | None = None
        async for out in async_engine.generate(list(range(5, 50)), SamplingParams(
                max_tokens=300, temperature=0, ignore_eos=True), request_id="to-abort"):
            last = out
            if len(out.token_ids) == 2:
                await async_engine.abort("to-abort")
        assert last is not None
        return last

    last = asyncio.run(main())
    assert last.finished and last.finish_reason == "abort"
    assert async_engine.stats().kv_blocks_used == 0


def test_bad_input_raises_before_entering(async_engine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="prompt is empty"):
            await _collect(async_engine, [], SamplingParams())
        with pytest.raises(ValueError, match="exceeds the model's context"):
            await _collect(async_engine, [5] * 1000, SamplingParams(max_tokens=100))
        # still serving
        outs = await _collect(async_engine, [5, 6], SamplingParams(max_tokens=2,
                                                                   ignore_eos=True))
        assert outs[-1].finished

    asyncio.run(main())


def test_duplicate_request_id_is_refused(async_engine: AsyncEngine) -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        first = async_engine.generate([5, 6, 7], params, request_id="dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(async_engine, [5, 6], params, request_id="dup")
        await first.aclose()

    asyncio.run(main())


def test_the_engine_is_built_on_the_thread_that_steps_it(tiny_model_dir: Path) -> None:
    # Building on the caller's thread left torch's OpenMP runtime two worker teams, which
    # on a small host made every step ~60% slower (engine/engine_thread.py).
    where: list[str] = []

    def build() -> LLMEngine:
        where.append(threading.current_thread().name)
        return LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))

    engine = AsyncEngine(build)
    try:
        assert where == ["loragate-engine"]
        assert engine.engine.config.num_kv_blocks == 64
    finally:
        engine.shutdown()

    def broken() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken)


def test_a_request_still_being_prepared_at_shutdown_is_an_engine_error(
        tiny_model_dir: Path) -> None:
    # Not a CancelledError nobody asked for: a gateway takes an engine error as "retry on
    # another instance", a cancellation as the client gone.
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    release = threading.Event()

    async def scenario() -> object:
        busy = asyncio.ensure_future(engine._preparing.run(release.wait))
        request = GenerateRequest("queued", [5, 6, 7],
                                  SamplingParams(max_tokens=2, bad_words=("no",)))
        opening = asyncio.create_task(engine.open(request))  # queued behind `busy`
        await asyncio.sleep(0.1)
        threading.Timer(0.2, release.set).start()
        engine.shutdown()  # returns once `busy` has: what runs finishes
        await busy
        return (await asyncio.gather(opening, return_exceptions=True))[0]

    try:
        outcome = asyncio.run(scenario())
    finally:
        release.set()
        engine.shutdown()
    assert isinstance(outcome, EngineDeadError), outcome
    with pytest.raises(EngineDeadError):  # and one arriving after it
        asyncio.run(engine.open(GenerateRequest(
            "late", [5, 6, 7], SamplingParams(max_tokens=2, bad_words=("no",)))))


def test_requests_are_prepared_in_their_tenants_turn(async_engine: AsyncEngine) -> None:
    # Bad words are spelled on the preparing thread: each request queues in its tenant's
    # line there (GenerateRequest.tenant), and all are then served.
    release = threading.Event()
    slow = SamplingParams(max_tokens=2, bad_words=("no",), ignore_eos=True)

    async def scenario() -> list[int]:
        started = threading.Event()

        def block() -> bool:
            started.set()
            return release.wait(30)

        busy = asyncio.ensure_future(async_engine._preparing.run(block, "flood"))
        assert await asyncio.to_thread(started.wait, 30)
        opened = [asyncio.ensure_future(async_engine.open(GenerateRequest(
            f"r{k}", [5, 6, 7], slow, tenant=tenant)))
            for k, tenant in enumerate(["flood", "flood", "flood", "quiet", None])]
        await asyncio.sleep(0)
        assert async_engine._preparing.queued() == {"flood": 3, "quiet": 1, None: 1}
        release.set()
        await busy
        counts = []
        for stream in await asyncio.gather(*opened):
            counts.append(sum([len(chunk.delta_token_ids) async for chunk in stream]))
        return counts

    try:
        assert asyncio.run(scenario()) == [2] * 5
    finally:
        release.set()
