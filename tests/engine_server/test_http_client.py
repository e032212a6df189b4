"""The gateway's engine client (gateway/engine_client.py) against the live engine: a chunk
of megabytes (a long prompt's prompt_logprobs, one NDJSON line) arrives whole."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from engine.protocol import GenerateRequest, StreamChunk
from engine.sampling_params import SamplingParams
from gateway.engine_client import HttpEngineClient
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
