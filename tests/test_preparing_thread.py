"""The engine's preparing thread: tenants take turns, a tenant's own work stays in order,
a caller that goes away drops its queued work, errors reach their caller, shutdown refuses."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from engine.engine_thread import EngineDeadError
from engine.preparing_thread import PreparingThread


def _recorder(done: list[str], name: str) -> Callable[[], str]:
    def work() -> str:
        done.append(name)
        return name
    return work


async def _blocked(preparing: PreparingThread, release: threading.Event,
                   tenant: str | None) -> asyncio.Future[bool]:
    """Occupy the thread with `tenant`'s work until `release` is set."""
    started = threading.Event()

    def block() -> bool:
        started.set()
        return release.wait(30)

    busy = asyncio.ensure_future(preparing.run(block, tenant))
    assert await asyncio.to_thread(started.wait, 30)
    return busy


def test_tenants_take_turns_and_each_keeps_its_own_order() -> None:
    preparing = PreparingThread()
    done: list[str] = []
    release = threading.Event()

    async def scenario() -> list[str]:
        busy = await _blocked(preparing, release, "flood")
        runs = [asyncio.ensure_future(preparing.run(_recorder(done, f"flood{k}"), "flood"))
                for k in range(1, 5)]
        runs.append(asyncio.ensure_future(preparing.run(_recorder(done, "b"), "b")))
        runs.append(asyncio.ensure_future(preparing.run(_recorder(done, "op"))))
        runs.append(asyncio.ensure_future(preparing.run(_recorder(done, "b2"), "b")))
        await asyncio.sleep(0)  # every run() has queued its work
        assert preparing.queued() == {"flood": 4, "b": 2, None: 1}
        release.set()
        assert await busy is True
        return list(await asyncio.gather(*runs))

    try:
        results = asyncio.run(scenario())
    finally:
        release.set()
        preparing.shutdown()
    assert results == ["flood1", "flood2", "flood3", "flood4", "b", "op", "b2"]
    # The flood's item ran while the others arrived: they go before its next one, then one
    # turn each.
    assert done == ["b", "op", "flood1", "b2", "flood2", "flood3", "flood4"]
    assert preparing.queued() == {}


def test_a_cancelled_caller_drops_its_queued_work_and_errors_reach_their_caller() -> None:
    preparing = PreparingThread()
    done: list[str] = []
    release = threading.Event()

    def fails() -> None:
        raise ValueError("grammar too large")

    async def scenario() -> None:
        busy = await _blocked(preparing, release, "a")
        gone = asyncio.ensure_future(preparing.run(_recorder(done, "gone"), "a"))
        failing = asyncio.ensure_future(preparing.run(fails, "b"))
        kept = asyncio.ensure_future(preparing.run(_recorder(done, "kept"), "a"))
        await asyncio.sleep(0)
        gone.cancel()
        for _ in range(3):  # the cancellation reaches its queued work through loop callbacks
            await asyncio.sleep(0)
        release.set()
        await busy
        with pytest.raises(asyncio.CancelledError):
            await gone
        with pytest.raises(ValueError, match="grammar too large"):
            await failing
        assert await kept == "kept"

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        preparing.shutdown()
    assert done == ["kept"]


def test_shutdown_fails_queued_work_as_an_engine_error_and_refuses_more() -> None:
    preparing = PreparingThread()
    release = threading.Event()

    async def scenario() -> tuple[object, object]:
        busy = await _blocked(preparing, release, None)
        queued = asyncio.ensure_future(preparing.run(lambda: "never", "a"))
        await asyncio.sleep(0)
        threading.Timer(0.2, release.set).start()
        preparing.shutdown()  # returns once the running work has
        assert release.is_set()
        return await busy, (await asyncio.gather(queued, return_exceptions=True))[0]

    try:
        ran, queued = asyncio.run(scenario())
    finally:
        release.set()
        preparing.shutdown()
    assert ran is True  # what was running finished
    assert isinstance(queued, EngineDeadError), queued
    with pytest.raises(EngineDeadError, match="has shut down"):
        asyncio.run(preparing.run(lambda: "late"))
