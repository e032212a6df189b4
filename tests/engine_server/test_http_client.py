"""The gateway's engine client (gateway/engine_client.py) and poller (gateway/instances.py)
against the live engine: a chunk of megabytes (a long prompt's prompt_logprobs, one NDJSON
line) arrives whole; an engine slower than the poll timeout is busy, not frozen."""

from __future__ import annotations

import asyncio
import random
import socket

import aiohttp

from engine.protocol import GenerateRequest, StreamChunk
from engine.sampling_params import SamplingParams
from gateway.engine_client import ClientTimeouts, HttpEngineClient
from gateway.instances import Instance, InstancePool
from tests.engine_server.helpers import CONTEXT
from tests.live_servers import LiveServer


def test_a_chunk_of_megabytes_arrives_whole(engine: LiveServer) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(5, 500) for _ in range(CONTEXT - 24)]
    request = GenerateRequest("big-line", prompt, SamplingParams(
        max_tokens=1, prompt_logprobs=20, logprobs=20, ignore_eos=True))

    async def scenario() -> tuple[list[StreamChunk], int]:
        async with aiohttp.ClientSession() as session:
            client = HttpEngineClient(engine.url, session)
            # What the engine sends for it, counted on a connection of its own.
            async with session.post(engine.url + "/generate",
                                    json={**request.to_json(), "request_id": "size",
                                          "stream": True}) as response:
                longest = max(len(line) for line in (await response.read()).split(b"\n"))
            stream = await client.open(request)
            return [chunk async for chunk in stream], longest

    chunks, longest = asyncio.run(scenario())
    assert longest > 1 << 19  # over aiohttp's own line limit (512 KiB)
    assert chunks[-1].finished and chunks[-1].error is None
    scored = [c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None]
    assert len(scored) == 1 and len(scored[0]) == len(prompt)


def test_an_engine_slower_than_the_poll_timeout_is_busy_not_frozen(engine: LiveServer) -> None:
    """A state call that times out while /health answers (a step longer than the state
    timeout) keeps the instance; a server that takes connections and answers nothing gets
    no new request from the first such poll, and is ejected."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog), never answers
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"

    async def scenario() -> tuple[Instance, Instance]:
        async with aiohttp.ClientSession() as session:
            pool = InstancePool([engine.url, silent_url], session, eject_after=2)
            busy, frozen = pool.instances[engine.url], pool.instances[silent_url]
            await pool.poll()
            assert busy.healthy
            # No state call makes it in time.
            hurried = ClientTimeouts(connect=0.2, control=10.0, state=0.001)
            for instance in (busy, frozen):
                instance.client = HttpEngineClient(instance.instance_id, session, hurried)
            # As if it had answered before it froze.
            frozen.healthy, frozen.consecutive_failures, frozen.silent_since = True, 0, None
            await pool.poll()
            # One silent poll: not ejected yet (eject_after 2), but no new request goes there.
            assert frozen.healthy and pool.healthy() == [busy]
            for _ in range(2):
                await pool.poll()
            return busy, frozen

    with silent:
        busy, frozen = asyncio.run(scenario())
    assert (busy.healthy, busy.busy, busy.consecutive_failures) == (True, True, 0)
    assert (frozen.healthy, frozen.busy) == (False, False)
