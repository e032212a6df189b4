"""Faults with live processes: an engine crash mid-stream, client disconnects, admission
bound, no ready engine, graceful drains (SIGTERM) of an engine and of a gateway, timeouts.

Every process is started once for the module (concurrently); a test that kills or drains a
process owns it, so the tests do not depend on their order. Engines have 2 sequence slots,
so a third and fourth request on one engine wait in its queue without a token.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.exposure import instance_tag
from tests.live_http import (
    StreamResult,
    engine_state,
    error_of,
    instances,
    metric,
    poll,
    sse_events,
    stream_into,
    until_async,
    wait_engines_idle,
)
from tests.live_servers import LiveServer, start_engine, start_gateway

MODEL = "tiny"
ENGINE_FLAGS = ("--num-kv-blocks", "512", "--max-num-seqs", "2")
GATEWAY_FLAGS = ("--served-model-name", MODEL)
PROMPT = list(range(40, 64))  # 24 tokens: room for 1000 new ones in the 1024-token context


@dataclass
class Servers:
    survivor: LiveServer
    """Shared engine: every gateway but `drained_gw` routes to it."""
    victim: LiveServer
    """Engine SIGKILLed by the crash test."""
    drained: LiveServer
    """Engine SIGTERMed by the engine drain test."""
    frozen: LiveServer
    """Engine SIGSTOPped (then resumed) by the freeze test."""
    pair_gw: LiveServer
    """Round robin over survivor and victim (crash and disconnect tests)."""
    lone_gw: LiveServer
    """Over victim only (crash test: nowhere to retry)."""
    bounded_gw: LiveServer
    """--max-in-flight-per-instance 1 over survivor."""
    timeout_gw: LiveServer
    """--request-timeout-s 0.25 over survivor: a quarter of the fastest 1,000-token generation
    seen here (the tiny model decodes a token in about 1 ms)."""
    drained_gw: LiveServer
    """Over `drained` only (its engine drains away: then no instance is ready)."""
    stopping_gw: LiveServer
    """Over survivor; SIGTERMed by the gateway drain test."""
    frozen_gw: LiveServer
    """Round robin over survivor and frozen, ejecting after one failed poll."""


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Servers]:
    logs = tmp_path_factory.mktemp("fault-logs")
    started: list[LiveServer] = []

    def engine() -> LiveServer:
        started.append(start_engine(tiny_model_dir, logs, *ENGINE_FLAGS))
        return started[-1]

    def gateway(engines: list[LiveServer], *extra: str) -> LiveServer:
        started.append(start_gateway(tiny_model_dir, [e.url for e in engines], logs,
                                     *GATEWAY_FLAGS, *extra))
        return started[-1]

    try:
        survivor, victim, drained, frozen = engine(), engine(), engine(), engine()
        all_ = Servers(
            survivor, victim, drained, frozen,
            pair_gw=gateway([survivor, victim], "--routing", "round_robin"),
            lone_gw=gateway([victim]),
            bounded_gw=gateway([survivor], "--max-in-flight-per-instance", "1"),
            timeout_gw=gateway([survivor], "--request-timeout-s", "0.25"),
            drained_gw=gateway([drained]),
            stopping_gw=gateway([survivor]),
            frozen_gw=gateway([survivor, frozen], "--routing", "round_robin",
                              "--eject-after-failures", "1"))
        for server in started:
            server.wait_ready()
        poll(lambda: all(i["healthy"] for i in instances(all_.pair_gw.url).values()),
             "the round-robin gateway to see both engines")
        yield all_
    finally:
        for server in started:
            server.stop()


def body(max_tokens: int, stream: bool = False, prompt: list[int] | None = None,
         **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "prompt": prompt or PROMPT, "max_tokens": max_tokens,
                         "temperature": 0.0, "ignore_eos": True, "stream": stream, **extra}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


def assert_completed(events: list[Any], max_tokens: int) -> None:
    """A stream that ended normally: tokens, finish_reason "length", usage, [DONE]."""
    assert events[-1] == "[DONE]"
    assert not [e for e in events[:-1] if "error" in e], events
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == max_tokens
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    if events[0]["choices"][0]["logprobs"] is not None:  # every event carries its tokens
        counts = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events[:-2]]
        assert min(counts) >= 1 and sum(counts) == max_tokens, counts


def generated(engine: LiveServer) -> float:
    return metric(httpx.get(engine.url + "/metrics").text, "loragate_generation_tokens_total")


# ------------------------------------------------------------------------ engine crash
def test_engine_crash_fails_started_streams_and_retries_the_others(servers: Servers) -> None:
    survivor, victim, gw = servers.survivor, servers.victim, servers.pair_gw
    wait_engines_idle(survivor.url, victim.url)
    retries_before = metric(httpx.get(gw.url + "/metrics").text,
                            "loragate_gateway_retries_total", reason="EngineStreamBroken")
    max_tokens = 990  # long enough that no victim stream can finish before the kill
    results = [StreamResult() for _ in range(8)]
    lone = StreamResult()  # through a gateway that has no other engine to retry on
    wholes: list[asyncio.Task[httpx.Response]] = []

    async def scenario() -> set[int]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            tasks = [asyncio.create_task(stream_into(
                client, gw.url + "/v1/completions",
                body(max_tokens, stream=True, prompt=[*PROMPT, i], logprobs=0), result))
                for i, result in enumerate(results)]
            # Round robin: 4 streams per engine, 2 running (tokens flowing) and 2 queued.
            await until_async(lambda: sum(bool(r.events) for r in results
                                     if r.instance == instance_tag(victim.url)) == 2,
                         "two streams with tokens from the victim")
            tasks.append(asyncio.create_task(stream_into(
                client, servers.lone_gw.url + "/v1/completions",
                body(max_tokens, stream=True), lone)))
            await until_async(lambda: lone.status != 0, "the victim to accept the lone stream")
            # Two whole responses, one per engine: the victim's waits in its queue.
            wholes.extend(asyncio.create_task(client.post(
                gw.url + "/v1/completions", json=body(4, prompt=[*PROMPT, 100 + i])))
                for i in range(2))
            await until_async(lambda: engine_state(victim.url)["num_waiting"] == 3,
                              "the victim to queue the whole response")
            victim.kill()
            started_on_victim = {i for i, r in enumerate(results)
                                 if r.instance == instance_tag(victim.url) and r.events}
            await asyncio.wait_for(asyncio.gather(*tasks, *wholes), 60.0)
            return started_on_victim

    started_on_victim = asyncio.run(scenario())
    assert [r.status for r in results] == [200] * 8
    assert sorted(r.instance for r in results) == sorted(
        [instance_tag(survivor.url)] * 4 + [instance_tag(victim.url)] * 4)
    for i, result in enumerate(results):
        if i in started_on_victim:  # tokens already sent: a clear error, then the end
            assert result.events[-1] == "[DONE]"
            # The tail in the message: this failed once (of many runs) with a non-error event
            # there; what it was is the clue.
            assert isinstance(result.events[-2], dict) and "error" in result.events[-2], (
                result.instance, len(result.events), result.events[-4:])
            error = result.events[-2]["error"]
            assert error["message"].startswith("the engine instance failed mid-response"), error
            # OpenAI's error schema, as a whole response's: param present (null here).
            assert (error["type"], error["param"], error["code"]) == (
                "server_error", None, "engine_error")
        else:  # survivor's own, and the victim's queued ones retried on the survivor
            assert_completed(result.events, max_tokens)
    assert len(started_on_victim) == 2
    for whole in wholes:  # retried on the survivor, and named so (not the engine that died)
        assert whole.result().status_code == 200, whole.result().text
        assert whole.result().headers["x-loragate-instance"] == instance_tag(survivor.url)
    assert not any(r.truncated for r in results)
    # Accepted, no token yet, and no instance left: an error event, not a cut connection.
    assert (lone.status, lone.instance, lone.truncated) == (200, instance_tag(victim.url), False)
    assert lone.events == [{"error": {
        "message": "no engine instance is ready; retry later", "type": "service_unavailable",
        "param": None, "code": "unavailable"}}, "[DONE]"]
    retries = metric(httpx.get(gw.url + "/metrics").text, "loragate_gateway_retries_total",
                     reason="EngineStreamBroken")
    assert retries - retries_before == 2  # the two queued streams (the whole response's
    # retry may count under another reason: its connection can fail before the stream)

    view = instances(gw.url)
    assert (view[victim.url]["healthy"], view[survivor.url]["healthy"]) == (False, True)
    for _ in range(2):  # round robin has one candidate left
        response = httpx.post(gw.url + "/v1/completions", json=body(2), timeout=60.0)
        assert response.status_code == 200
        assert response.headers["x-loragate-instance"] == instance_tag(survivor.url)
    wait_engines_idle(survivor.url)


def test_a_frozen_engine_is_ejected_and_its_requests_do_not_wait_for_it(
        servers: Servers) -> None:
    # SIGSTOP: the engine neither answers nor closes its connections. Its state poll times
    # out and the gateway ejects it; the requests it holds must not wait for their deadline
    # (600 s): those with tokens end with an error, the one still queued runs elsewhere.
    survivor, frozen, gw = servers.survivor, servers.frozen, servers.frozen_gw
    poll(lambda: all(i["healthy"] for i in instances(gw.url).values()),
         "the gateway to see both engines")
    wait_engines_idle(survivor.url, frozen.url)
    max_tokens = 990
    results = [StreamResult() for _ in range(6)]  # 3 per engine: 2 running, 1 queued

    async def scenario() -> tuple[set[int], float]:
        async with httpx.AsyncClient(timeout=120.0) as client:
            tasks = [asyncio.create_task(stream_into(
                client, gw.url + "/v1/completions",
                body(max_tokens, stream=True, prompt=[*PROMPT, i]), result))
                for i, result in enumerate(results)]
            await until_async(lambda: sum(bool(r.events) for r in results
                                     if r.instance == instance_tag(frozen.url)) == 2,
                         "two streams with tokens from the engine to freeze")
            frozen.process.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                started = {i for i, r in enumerate(results)
                           if r.instance == instance_tag(frozen.url) and r.events}
                # Sent after the freeze, before the ejection: round robin gives one of
                # them to the frozen engine, and it must not wait for it either.
                # A scenario's timing, not a wait for an outcome: later than the first state
                # call that times out began (the gateway polls every 0.2 s).
                await asyncio.sleep(3.0)
                later = [asyncio.create_task(client.post(
                    gw.url + "/v1/completions", json=body(4, prompt=[*PROMPT, 50 + i])))
                    for i in range(2)]
                await asyncio.wait_for(asyncio.gather(*tasks, *later), 90.0)
                assert [t.result().status_code for t in later] == [200, 200]
                return started, time.monotonic() - stopped_at
            finally:
                frozen.process.send_signal(signal.SIGCONT)

    started, took = asyncio.run(scenario())
    assert took < 60.0  # the control timeout (10 s) and a poll, not the request deadline
    assert [r.status for r in results] == [200] * 6 and len(started) == 2
    for i, result in enumerate(results):
        if i in started:
            error = result.events[-2]["error"]
            assert error["message"].startswith("the engine instance failed mid-response")
        else:  # survivor's own, and the frozen engine's queued one retried there
            assert_completed(result.events, max_tokens)
    assert "after 1 failed polls" in gw.log()  # ejected while frozen
    poll(lambda: instances(gw.url)[frozen.url]["healthy"], "the resumed engine to be back")
    wait_engines_idle(survivor.url, frozen.url)


# ----------------------------------------------------------------- client disconnects
def test_client_disconnect_from_the_gateway_frees_engine_blocks(servers: Servers) -> None:
    gw = servers.pair_gw
    with httpx.stream("POST", gw.url + "/v1/completions",
                      json=body(1000, stream=True), timeout=60.0) as response:
        assert response.status_code == 200
        engine = (servers.survivor if response.headers["x-loragate-instance"]
                  == instance_tag(servers.survivor.url) else servers.victim)
        engine_url = engine.url
        before = generated(engine)
        disconnected_before = metric(httpx.get(gw.url + "/metrics").text,
                                     "loragate_gateway_requests_total", status="499")
        events = sse_events(response)
        assert [next(events)["choices"][0]["finish_reason"] for _ in range(3)] == [None] * 3
        assert engine.process.poll() is None
    # The client is gone: the gateway must abort the request on its engine.
    wait_engines_idle(engine_url)
    assert generated(engine) - before < 1000
    poll(lambda: metric(httpx.get(gw.url + "/metrics").text, "loragate_gateway_requests_total",
                        status="499") == disconnected_before + 1,
         "the gateway to count the disconnected request (499)")
    assert instances(gw.url)[engine_url]["in_flight"] == 0


# --------------------------------------------------------------------- admission bound
def test_admission_bound_answers_429_with_retry_after(servers: Servers) -> None:
    gw = servers.bounded_gw
    wait_engines_idle(servers.survivor.url)
    with httpx.stream("POST", gw.url + "/v1/completions",
                      json=body(1000, stream=True), timeout=60.0) as held:
        assert held.status_code == 200
        events = sse_events(held)
        next(events)
        assert instances(gw.url)[servers.survivor.url]["in_flight"] == 1
        for stream in (False, True):
            response = httpx.post(gw.url + "/v1/completions", json=body(4, stream))
            assert response.status_code == 429
            assert response.headers["retry-after"] == "1"
            assert error_of(response) == {
                "message": "every engine instance is at its admission limit; retry later",
                "type": "rate_limit_error", "param": None, "code": "overloaded"}
    poll(lambda: instances(gw.url)[servers.survivor.url]["in_flight"] == 0,
         "the held stream to leave the gateway's count")
    response = httpx.post(gw.url + "/v1/completions", json=body(4), timeout=60.0)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4
    wait_engines_idle(servers.survivor.url)


# ------------------------------------------------------------------- request timeout
def test_request_timeout_answers_504_and_frees_engine_blocks(servers: Servers) -> None:
    gw, engine = servers.timeout_gw, servers.survivor
    wait_engines_idle(engine.url)
    before = generated(engine)
    response = httpx.post(gw.url + "/v1/completions", json=body(1000), timeout=60.0)
    assert response.status_code == 504
    assert error_of(response) == {"message": "request timed out after 0.25s",
                                  "type": "timeout_error", "param": None, "code": "timeout"}
    wait_engines_idle(engine.url)
    assert generated(engine) - before < 1000

    with httpx.stream("POST", gw.url + "/v1/completions", json=body(1000, stream=True),
                      timeout=60.0) as streamed:
        assert streamed.status_code == 200
        events = list(sse_events(streamed))
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "request timed out after 0.25s",
                                    "type": "timeout_error", "param": None,
                                    "code": "timeout"}}
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    wait_engines_idle(engine.url)


# ---------------------------------------------------------------------------- drains
def _refused_or_draining(request: httpx.Request) -> str | None:
    """How a new request to a draining server ends: "refused" (the listener is closed),
    "draining" (503 from the app), or None while it is still served normally."""
    try:
        with httpx.Client(timeout=5.0) as client:  # a fresh connection, not a pooled one
            response = client.send(request)
    except httpx.ConnectError:
        return "refused"
    if response.status_code == 503:
        payload = response.json()
        assert "draining" in (payload.get("status"), payload.get("error", {}).get("code"))
        return "draining"
    assert response.status_code == 200, response.text
    return None


def test_engine_sigterm_drains_its_stream_then_gateway_answers_503(servers: Servers
                                                                    ) -> None:
    engine, gw = servers.drained, servers.drained_gw
    max_tokens = 400
    no_instance = {"message": "no engine instance is ready; retry later",
                   "type": "service_unavailable", "param": None, "code": "unavailable"}
    with httpx.stream("POST", gw.url + "/v1/completions",
                      json=body(max_tokens, stream=True), timeout=60.0) as response:
        assert response.status_code == 200
        assert response.headers["x-loragate-instance"] == instance_tag(engine.url)
        events = sse_events(response)
        seen = [next(events)]
        engine.process.send_signal(signal.SIGTERM)
        health = httpx.Request("GET", engine.url + "/health")
        # It keeps listening while its stream finishes: probes learn why it is going.
        assert poll(lambda: _refused_or_draining(health),
                    "the engine's /health to say draining") == "draining"
        assert engine.process.poll() is None  # still finishing the stream
        # Its refusal says when to retry, and closes the connection: reconnect elsewhere.
        turned_away = httpx.post(engine.url + "/generate", timeout=10.0, json={
            "prompt_token_ids": [5, 6, 7], "stream": False, "params": {"max_tokens": 2}})
        assert (turned_away.status_code, error_of(turned_away)["code"]) == (503, "draining")
        assert turned_away.headers["retry-after"] == "1"
        assert turned_away.headers["connection"] == "close"
        poll(lambda: not instances(gw.url)[engine.url]["healthy"],
             "the gateway to take the draining engine out of rotation")
        refused = httpx.post(gw.url + "/v1/completions", json=body(4))
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert error_of(refused) == no_instance
        seen += list(events)
    assert_completed(seen, max_tokens)
    assert engine.process.wait(30) == 0
    assert "drains: no new requests; those running finish" in engine.log()
    response = httpx.post(gw.url + "/v1/completions", json=body(4), timeout=30.0)
    assert response.status_code == 503
    assert error_of(response) == no_instance
    health_response = httpx.get(gw.url + "/health")
    assert (health_response.status_code, health_response.json()) == (
        503, {"status": "no_instances", "ready_instances": 0})
    # Gone, not draining: ejected once its polls fail, and never said to be up meanwhile.
    poll(lambda: not instances(gw.url)[engine.url]["draining"],
         "the gateway to eject the engine that drained and exited")
    assert f"ejecting {engine.url}" in gw.log()
    assert gw.log().count(f"instance {engine.url} is up") == 1, gw.log()


def test_gateway_sigterm_finishes_in_flight_stream_and_refuses_new_requests(
        servers: Servers) -> None:
    gw = servers.stopping_gw
    wait_engines_idle(servers.survivor.url)
    max_tokens = 400
    with httpx.stream("POST", gw.url + "/v1/completions",
                      json=body(max_tokens, stream=True), timeout=60.0) as response:
        assert response.status_code == 200
        events = sse_events(response)
        seen = [next(events)]
        gw.process.send_signal(signal.SIGTERM)
        new = httpx.Request("POST", gw.url + "/v1/completions", json=body(1))
        assert poll(lambda: _refused_or_draining(new),
                    "the gateway to refuse new requests") == "draining"
        assert gw.process.poll() is None  # still finishing the stream
        seen += list(events)
    assert_completed(seen, max_tokens)
    assert gw.process.wait(30) == 0
    wait_engines_idle(servers.survivor.url)
