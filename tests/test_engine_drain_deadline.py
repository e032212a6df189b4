"""An engine server whose drain runs out of time (--drain-timeout-s) ends the requests still
running or waiting as a shutdown: each stream's last line is a "shutting_down" error (what
a gateway passes on as a 503 of that code), their blocks are freed, and the process exits
cleanly, with no traceback in its log. A gateway runs on another engine what such an
engine cut before any of it reached the client."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from engine.async_engine import STOPPED_MESSAGE, AsyncEngine
from engine.config import EngineConfig
from engine.metrics import EngineStats
from engine.protocol import GenerateRequest
from engine.sampling_params import SamplingParams
from tests.live_http import instances, poll
from tests.live_servers import running, start_engine, start_gateway

LONG: dict[str, Any] = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0.0}
PROMPT = list(range(40, 64))


def test_cut_off_ends_every_request_with_a_shutting_down_error(tiny_model_dir: Path) -> None:
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256,
                                                  max_num_seqs=1))

    async def scenario() -> tuple[list[tuple[int, str | None, str | None]], EngineStats]:
        streams = [await engine.open(GenerateRequest(
            f"r{i}", PROMPT, SamplingParams(**LONG)))
            for i in range(3)]  # one runs, two wait (max_num_seqs 1)
        first = await anext(aiter(streams[0]))
        assert first.error is None
        assert engine.cut_off() == 3
        ends = []
        for stream in streams:
            chunks = [first] if stream is streams[0] else []
            async for chunk in stream:
                chunks.append(chunk)
            last = chunks[-1]
            error = last.error
            ends.append((sum(len(c.delta_token_ids) for c in chunks),
                         None if error is None else error.code,
                         None if error is None else error.message))
        return ends, await engine.fresh_stats()

    try:
        ends, stats = asyncio.run(scenario())
        assert [(code, message) for _, code, message in ends] == \
            [("shutting_down", STOPPED_MESSAGE)] * 3
        assert ends[0][0] < LONG["max_tokens"]
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    finally:
        engine.shutdown()


def test_cut_off_ends_the_streams_without_waiting_for_the_engine_thread(
        tiny_model_dir: Path) -> None:
    """At the drain deadline the server gives the cut streams a second to send their last
    chunk; a long CPU step in progress must not hold them. The engine thread is held here
    by a command (what a step would do): the streams end before it is let go, and the
    requests' blocks are freed once it is."""
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256,
                                                  max_num_seqs=1))
    release = threading.Event()

    async def scenario() -> tuple[list[str | None], bool, EngineStats]:
        streams = [await engine.open(GenerateRequest(f"r{i}", PROMPT, SamplingParams(**LONG)))
                   for i in range(2)]
        await anext(aiter(streams[0]))
        held = asyncio.ensure_future(engine.call(lambda: release.wait(60)))
        await asyncio.sleep(0.05)  # the engine thread is in the command now
        engine.cut_off()
        codes = []
        for stream in streams:
            last = None
            async for chunk in stream:
                last = chunk
            codes.append(None if last is None or last.error is None else last.error.code)
        still_held = not held.done()
        release.set()
        await held
        return codes, still_held, await engine.fresh_stats()

    try:
        codes, still_held, stats = asyncio.run(scenario())
        assert codes == ["shutting_down"] * 2 and still_held
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    finally:
        release.set()
        engine.shutdown()


def test_a_gateway_runs_elsewhere_what_a_stopping_engine_cut_before_the_client_saw_it(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    stopping = start_engine(tiny_model_dir, tmp_path, "--max-num-seqs", "1",
                            "--drain-timeout-s", "0.5")
    other = start_engine(tiny_model_dir, tmp_path)
    gateway = start_gateway(tiny_model_dir, [stopping.url, other.url], tmp_path,
                            "--served-model-name", "tiny")
    answers: list[httpx.Response] = []

    def complete(i: int) -> None:
        # Whole responses: nothing reaches the client before the end, so every cut request
        # can start over elsewhere. Distinct prompts: no prefix pulls them to one engine.
        answers.append(httpx.post(gateway.url + "/v1/completions", timeout=120.0, json={
            "model": "tiny", "prompt": [100 + i, *PROMPT], "max_tokens": 900,
            "ignore_eos": True, "temperature": 0.0}))

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(6)]
    with running(stopping, other, gateway):
        # The gateway answers /health once one engine is up: requests sent before it sees
        # both go to one of them (all to the other: nothing to cut; all to the stopping
        # one: nowhere to run them again).
        poll(lambda: len(instances(gateway.url)) == 2 and all(
            i["healthy"] for i in instances(gateway.url).values()),
            "the gateway to see both engines up")
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while httpx.get(stopping.url + "/health").json()["in_flight"] < 1:
            assert time.monotonic() < deadline, "the gateway sent the stopping engine nothing"
            time.sleep(0.01)
        stopping.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
        assert stopping.process.wait(30) == 0
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [900] * 6
    log = stopping.log()
    cut = re.search(r"stops: (\d+) request\(s\) still running are ended with a "
                    r"'shutting_down' error", log)
    assert cut is not None and int(cut.group(1)) >= 1, log
    assert "Traceback" not in log, log
    assert "retrying" in gateway.log(), gateway.log()
