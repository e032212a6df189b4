"""Concurrent requests through the official async `openai` client, and a client that hangs
up mid-stream. Against the package's live engine + gateway (conftest.py)."""

from __future__ import annotations

import asyncio

import httpx
import openai

from tests.live_servers import LiveServer
from tests.openai_api.helpers import (
    MESSAGES,
    NO_EOS,
    PROMPT,
    wait_engine_idle,
)


def test_async_client_concurrent_requests_match_sequential_ones(
        gateway: LiveServer, client: openai.OpenAI, base_model: str) -> None:
    models = [base_model, "a0", "a1"]
    sequential = [client.chat.completions.create(
        model=m, messages=MESSAGES, max_tokens=8, temperature=0, extra_body=NO_EOS
    ).choices[0].message.content for m in models]

    async def run() -> tuple[list[str | None], list[str]]:
        async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=60.0) as aclient:
            async def whole(model: str) -> str | None:
                done = await aclient.chat.completions.create(
                    model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                    extra_body=NO_EOS)
                return done.choices[0].message.content

            async def streamed(model: str) -> str:
                stream = await aclient.chat.completions.create(
                    model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                    extra_body=NO_EOS, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream])

            results = await asyncio.gather(*(whole(m) for m in models),
                                           *(streamed(m) for m in models))
            return list(results[:3]), [str(r) for r in results[3:]]

    together, streamed_together = asyncio.run(run())
    assert together == sequential
    assert streamed_together == sequential


def test_client_disconnect_mid_stream_frees_engine_blocks(
        client: openai.OpenAI, engine: LiveServer, base_model: str) -> None:
    stream = client.completions.create(model=base_model, prompt=PROMPT, max_tokens=900,
                                       extra_body=NO_EOS, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].finish_reason is None
    running = httpx.get(engine.url + "/state").json()
    assert running["num_running"] == 1 and running["kv_blocks_used"] > 0
    stream.close()
    wait_engine_idle(engine.url)
