"""A step that raises fails the request that caused it, never the batch; nothing a client
does (cancelling, hostile parameters) stops the engine thread.

Failures are injected by wrapping the real runner's methods (the real forward and sampler
still run for every other request): no client input can make a validated step raise, which
is the point, so a bug has to be simulated to test what happens when one slips through.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import STEP_FAILED_MESSAGE, LLMEngine
from engine.protocol import EngineUnavailable
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = {f"r{i}": list(range(3 + i, 60 + 7 * i)) for i in range(5)}


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine.from_model(str(model_dir), num_kv_blocks=64, max_num_batched_tokens=64,
                                max_model_len=512, **overrides)


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY,
         lora: str | None = None) -> dict[str, RequestOutput]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params, lora=lora)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.isolation.suspects == []
    engine.step()  # hands the runner the last finished ids: it must then hold nothing
    assert engine.runner.batch.requests == {}
    return done


def _break_when(engine: LLMEngine, culprit: Callable[[SchedulerOutput], bool]) -> list[int]:
    """Make the runner raise for every step ``culprit`` accepts; returns a failure count."""
    failures = [0]
    execute = engine.runner.execute

    def failing_execute(sched: SchedulerOutput) -> Any:
        if culprit(sched):
            failures[0] += 1
            raise RuntimeError("injected failure: secret detail of request 'bad'")
        return execute(sched)

    engine.runner.execute = failing_execute  # type: ignore[method-assign]
    return failures


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[str, list[int]]:
    done = _run(_engine(tiny_model_dir), PROMPTS)
    return {r: out.token_ids for r, out in done.items()}


@pytest.mark.parametrize("when", ["prefill", "sample"])
def test_a_failing_request_fails_alone(tiny_model_dir: Path, reference: dict[str, list[int]],
                                       when: str) -> None:
    engine = _engine(tiny_model_dir)
    _break_when(engine, lambda s: any(
        c.request_id == "bad" and (c.sample or when == "prefill") for c in s.chunks))
    done = _run(engine, {**PROMPTS, "bad": list(range(10, 90))})
    assert done["bad"].finish_reason == "error"
    assert done["bad"].error == STEP_FAILED_MESSAGE  # no exception text, no detail
    for request_id, tokens in reference.items():
        assert done[request_id].error is None
        assert done[request_id].token_ids == tokens


def test_a_failure_inside_the_runner_leaves_its_copies_consistent(
        tiny_model_dir: Path, reference: dict[str, list[int]]) -> None:
    """The failure comes after the runner took the step's deltas (new requests, grown block
    tables) and ran the forward: the rolled-back requests come back whole and finish with
    the tokens they would have had."""
    engine = _engine(tiny_model_dir)
    sample = engine.runner.sampler.sample

    def failing_sample(logits: Any, request_ids: list[str], *rest: Any) -> Any:
        if "bad" in request_ids:
            raise RuntimeError("injected failure in sampling")
        return sample(logits, request_ids, *rest)

    engine.runner.sampler.sample = failing_sample  # type: ignore[method-assign,assignment]
    done = _run(engine, {**PROMPTS, "bad": list(range(10, 90))})
    assert done["bad"].error == STEP_FAILED_MESSAGE
    assert {r: done[r].token_ids for r in reference} == reference


def test_a_failure_everywhere_fails_every_request_and_the_engine_goes_on(
        tiny_model_dir: Path, reference: dict[str, list[int]]) -> None:
    engine = _engine(tiny_model_dir)
    broken = [True]
    _break_when(engine, lambda s: bool(s.chunks) and broken[0])
    done = _run(engine, PROMPTS)
    assert {r: o.error for r, o in done.items()} == {r: STEP_FAILED_MESSAGE for r in PROMPTS}
    broken[0] = False
    again = _run(engine, PROMPTS)
    assert {r: o.token_ids for r, o in again.items()} == reference


def test_rollback_vacates_a_slot_whose_adapter_copy_may_not_have_happened(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    """A failed step placed an adapter in a slot but never copied its weights: the next
    step must load them again, not run on an empty slot."""
    clean = _engine(tiny_model_dir, max_loras=1)
    clean.load_lora("a0", str(tiny_adapters["a0"]))
    expected = _run(clean, {"x": PROMPTS["r0"]}, lora="a0")["x"].token_ids
    base = _run(clean, {"x": PROMPTS["r0"]})["x"].token_ids
    assert expected != base

    engine = _engine(tiny_model_dir, max_loras=1)
    engine.load_lora("a0", str(tiny_adapters["a0"]))
    loads: list[int] = []

    def fail_first_load(s: SchedulerOutput) -> bool:
        loads.extend(slot for slot, _ in s.lora_loads)
        return len(loads) == 1 and bool(s.lora_loads)

    _break_when(engine, fail_first_load)
    assert _run(engine, {"x": PROMPTS["r0"]}, lora="a0")["x"].token_ids == expected
    assert loads == [0, 0]  # placed, failed, placed again


# ------------------------------------------------------------------- AsyncEngine
@pytest.fixture(scope="module")
def async_engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_model_dir), num_kv_blocks=128, max_num_batched_tokens=32,
        max_model_len=1024))
    yield engine
    engine.shutdown()


def test_clients_cancelling_at_random_points_never_stop_the_engine(
        async_engine: AsyncEngine) -> None:
    """The hang-up that killed engines: a task awaiting a command is cancelled while the
    engine is busy, and the engine thread later completed the cancelled future."""
    rng = random.Random(7)
    long_prefill = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def consume(prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
        return [o async for o in async_engine.generate(prompt, params)]

    async def main() -> list[RequestOutput]:
        busy = [asyncio.create_task(consume([5 + i % 500 for i in range(900)], long_prefill))
                for _ in range(2)]
        victims = []
        for i in range(50):
            task = asyncio.create_task(consume(list(range(3, 40 + i)), GREEDY))
            await asyncio.sleep(rng.uniform(0, 0.01))
            victims.append(task)
            if rng.random() < 0.8:
                task.cancel()
        await asyncio.gather(*victims, return_exceptions=True)
        for task in busy:
            await task
        return await consume([7, 8, 9], GREEDY)

    last = asyncio.run(main())
    assert async_engine.is_alive()
    assert last[-1].finished and len(last[-1].token_ids) == 6
    stats = asyncio.run(async_engine.fresh_stats())
    assert stats.kv_blocks_used == 0
    assert stats.num_running == stats.num_waiting == 0


def test_a_command_cancelled_while_queued_is_never_applied(async_engine: AsyncEngine) -> None:
    """Commands queued while the engine thread is busy, then cancelled by their callers,
    are skipped whole; the thread goes on."""
    release = threading.Event()
    calls = [0]

    def count() -> None:
        calls[0] += 1

    async def main() -> None:
        blocker = asyncio.create_task(async_engine.call(release.wait))
        await asyncio.sleep(0.05)  # the engine thread is now inside release.wait()
        queued = [asyncio.create_task(async_engine.call(count)) for _ in range(20)]
        await asyncio.sleep(0)  # every task has enqueued its command
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        release.set()
        await blocker
        await async_engine.call(lambda: None)  # every queued command has been handled

    asyncio.run(main())
    assert calls[0] == 0
    assert async_engine.is_alive()


def test_a_dead_loop_calls_on_fatal_and_ends_every_stream(tiny_model_dir: Path) -> None:
    """If the loop dies anyway (here: even aborting fails), whoever runs the engine is told
    (the server exits so its supervisor restarts it) and no stream is left hanging."""
    deaths: list[BaseException] = []
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64),
                                     on_fatal=deaths.append)

    def broken(*_: Any) -> Any:
        raise RuntimeError("injected: engine state lost")

    engine.engine.step = broken  # type: ignore[method-assign]
    engine.engine.abort_request = broken  # type: ignore[method-assign, assignment]

    async def main() -> BaseException | None:
        try:
            async for _ in engine.generate([5, 6, 7], GREEDY):
                pass
        except Exception as exc:
            return exc
        return None

    error = asyncio.run(main())
    engine._thread.stop(timeout=10)
    assert type(error).__name__ == "EngineDeadError"
    assert not engine.is_alive()
    assert len(deaths) == 1 and engine.fatal_error is deaths[0]
    # A command sent now fails at once: nothing is left to run it, and nobody may hang.
    with pytest.raises(EngineUnavailable, match="engine thread is not running"):
        asyncio.run(engine.state())
    engine.shutdown()  # returns at once: the thread is gone
