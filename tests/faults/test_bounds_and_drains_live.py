"""Bounds and drains with live processes: the admission bound, the request timeout, and
graceful drains (SIGTERM) of an engine and of a gateway. Every process is started once for
the module (concurrently); a test that drains a process owns it, so the tests do not depend
on their order."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.exposure import instance_tag
from tests.faults.helpers import Fleet, assert_completed, body, generated
from tests.live_http import (
    error_of,
    instances,
    poll,
    sse_events,
    wait_engines_idle,
)
from tests.live_servers import LiveServer


@dataclass
class Servers:
    survivor: LiveServer
    """Shared engine: every gateway but `drained_gw` routes to it."""
    drained: LiveServer
    """Engine SIGTERMed by the engine drain test."""
    bounded_gw: LiveServer
    """--max-in-flight-per-instance 1 over survivor."""
    timeout_gw: LiveServer
    """--request-timeout-s 0.25 over survivor: a quarter of the fastest 1,000-token generation
    seen here (the tiny model decodes a token in about 1 ms)."""
    drained_gw: LiveServer
    """Over `drained` only (its engine drains away: then no instance is ready)."""
    stopping_gw: LiveServer
    """Over survivor; SIGTERMed by the gateway drain test."""


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Servers]:
    fleet = Fleet(tiny_model_dir, tmp_path_factory.mktemp("drain-logs"))
    try:
        survivor, drained = fleet.engine(), fleet.engine()
        all_ = Servers(
            survivor, drained,
            bounded_gw=fleet.gateway([survivor], "--max-in-flight-per-instance", "1"),
            timeout_gw=fleet.gateway([survivor], "--request-timeout-s", "0.25"),
            drained_gw=fleet.gateway([drained]),
            stopping_gw=fleet.gateway([survivor]))
        fleet.wait_ready()
        yield all_
    finally:
        fleet.stop()


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
