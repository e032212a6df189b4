"""Ending the waits on an instance that stopped answering (gateway/instances.py): which
waits end, which go on, and which state-call failures count as frozen."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest

from engine.protocol import EngineUnavailable
from gateway.engine_client import ClientTimeouts, HttpEngineClient
from gateway.instances import Instance, InstancePool, _frozen


async def _instance() -> tuple[Instance, aiohttp.ClientSession]:
    session = aiohttp.ClientSession()
    return Instance("http://127.0.0.1:9", HttpEngineClient("http://127.0.0.1:9", session)), \
        session


def test_end_waits_ends_those_begun_before_its_bound() -> None:
    """The gateway calls it with the present on ejection (every wait ends); a bound in the
    past leaves the later waits alone."""
    async def scenario() -> tuple[list[str], int]:
        instance, session = await _instance()
        loop = asyncio.get_running_loop()
        outcomes: list[str] = []

        async def wait(label: str) -> None:
            try:
                async with instance.watched(loop.time() + 30.0):
                    await asyncio.sleep(30.0)
                outcomes.append(f"{label}: finished")
            except EngineUnavailable:
                outcomes.append(f"{label}: ejected")

        old = asyncio.create_task(wait("old"))
        await asyncio.sleep(0.05)
        began = loop.time()
        await asyncio.sleep(0.05)
        new = asyncio.create_task(wait("new"))
        await asyncio.sleep(0.05)
        assert len(instance.waits) == 2
        instance.end_waits(began)
        await asyncio.wait_for(old, 5.0)
        pending = len(instance.waits)
        new.cancel()
        await asyncio.gather(new, return_exceptions=True)
        await session.close()
        return outcomes, pending

    outcomes, pending = asyncio.run(scenario())
    assert outcomes == ["old: ejected"]
    assert pending == 1  # the later wait is still there, and is gone once it ended


def test_a_wait_whose_deadline_fires_in_the_same_turn_times_out() -> None:
    async def scenario() -> BaseException | None:
        instance, session = await _instance()
        loop = asyncio.get_running_loop()

        async def wait() -> None:
            async with instance.watched(loop.time() + 0.01):
                await asyncio.sleep(5.0)

        task = asyncio.create_task(wait())
        await asyncio.sleep(0)  # the wait begins
        time.sleep(0.05)  # its deadline passes while the loop is blocked
        await asyncio.sleep(0)  # the loop's next turn runs the deadline's callback ...
        await asyncio.sleep(0)  # ... and this, before the wait's task resumes
        instance.end_waits(loop.time() + 1.0)  # the scope is expiring: left alone
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        assert not instance.waits
        await session.close()
        return outcome

    assert isinstance(asyncio.run(scenario()), TimeoutError)


def test_a_state_call_that_timed_out_means_the_engine_stopped_answering() -> None:
    def failure(cause: BaseException) -> EngineUnavailable:
        try:
            raise EngineUnavailable("state failed") from cause
        except EngineUnavailable as exc:
            return exc

    assert _frozen(failure(TimeoutError()))  # no answer on an open connection
    # No connection to a host that stopped answering (cut off, paused, powered down);
    # control calls have their own pool, so this is never a wait behind streams.
    assert _frozen(failure(aiohttp.ConnectionTimeoutError("connect")))
    assert not _frozen(failure(ConnectionRefusedError()))  # draining or dead: streams end
    assert not _frozen(failure(ValueError("malformed answer")))


def test_a_timeout_of_the_awaited_work_itself_is_not_an_ejection() -> None:
    async def scenario() -> None:
        instance, session = await _instance()
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError) as raised:
            async with instance.watched(loop.time() + 30.0):
                raise TimeoutError("the work's own")
        assert str(raised.value) == "the work's own"
        assert not instance.waits and not instance._ended
        await session.close()

    asyncio.run(scenario())


def test_a_frozen_engine_ends_the_waits_on_it_at_its_first_silent_poll() -> None:
    """A peer that takes connections and answers nothing (a SIGSTOPped engine: the kernel
    still accepts). Its first poll finds it silent (the state call and /health both time
    out): the waits on it end then, although ejection waits for --eject-after-failures
    polls, and it gets no new request meanwhile."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # never accepted: connections complete in the backlog, then silence
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def scenario() -> tuple[BaseException | None, bool, int, list[Instance]]:
        async with aiohttp.ClientSession() as session:
            pool = InstancePool([], session, eject_after=3)
            instance = Instance(url, HttpEngineClient(
                url, session, ClientTimeouts(connect=0.2, state=0.3)), healthy=True)
            pool.instances[url] = instance
            loop = asyncio.get_running_loop()

            async def wait() -> None:
                async with instance.watched(loop.time() + 30.0):
                    await asyncio.sleep(30.0)

            task = asyncio.create_task(wait())
            await asyncio.sleep(0.01)  # the wait begins before the poll
            await pool.poll()
            outcome = (await asyncio.gather(task, return_exceptions=True))[0]
            return outcome, instance.healthy, instance.consecutive_failures, pool.healthy()

    try:
        outcome, healthy, failures, routable = asyncio.run(scenario())
    finally:
        listener.close()
    assert isinstance(outcome, EngineUnavailable), outcome
    assert (healthy, failures, routable) == (True, 1, [])  # not ejected yet; no new request
