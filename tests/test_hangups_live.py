"""Clients that hang up (TCP reset) mid-request while the engine is busy never take an
engine down, and a crashed engine process is restarted by `loragate serve`.

Real processes throughout: a `loragate engine` and a gateway on loopback ports, clients
that reset their connections with SO_LINGER 0 (an RST, as a killed client or a load
balancer's timeout sends), and for the restart case a real `loragate serve` whose engine
child is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.demo_model import make_demo_model, make_peft_adapter
from engine.demo_shapes import DemoModelSpec
from gateway.serve import free_port
from tests.live_http import poll, sse_events, wait_engines_idle
from tests.live_servers import LiveServer, _spawn, running, start_engine, start_gateway

LONG_PROMPT = [5 + i % 400 for i in range(3000)]
HANGUPS = 50
# Wide enough that a 1,024-token prefill step takes a good fraction of a second on 2 cores:
# a hang-up then often lands while the request's admission waits for the running step.
SLOW_SPEC = DemoModelSpec(vocab_size=512, hidden_size=512, intermediate_size=1536,
                          num_layers=4, num_heads=8, num_kv_heads=4,
                          max_position_embeddings=4096, seed=3)


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = make_demo_model(tmp_path_factory.mktemp("slow-model"), SLOW_SPEC)
    make_peft_adapter(model, model / "a0", rank=8, target_modules=("q_proj", "v_proj"),
                      seed=9)
    return model


@pytest.fixture(scope="module")
def servers(slow_model: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[LiveServer, LiveServer]]:
    logs = tmp_path_factory.mktemp("hangup-logs")
    adapters = {"a0": slow_model / "a0"}
    engine = start_engine(slow_model, logs, "--max-num-batched-tokens", "1024",
                          "--num-kv-blocks", "1024", "--max-loras", "1", adapters=adapters)
    gateway = start_gateway(slow_model, [engine.url], logs, adapters=adapters)
    with running(engine, gateway):
        yield engine, gateway


def _body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}


def _reset_after(url: str, body: dict[str, Any], delay_s: float) -> None:
    """Send a streaming request, then reset the connection after delay_s."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        time.sleep(delay_s)
        # Linger on, timeout 0: close() sends RST instead of FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _stream_text(url: str, body: dict[str, Any]) -> tuple[int, int]:
    """(HTTP status, tokens streamed) of one complete streamed request."""
    with httpx.Client(timeout=120.0) as client, client.stream(
            "POST", url + "/v1/completions", json=body) as response:
        events = list(sse_events(response))
    assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    return response.status_code, sum(len(e["choices"][0]["text"]) > 0 for e in events
                                      if isinstance(e, dict) and e.get("choices"))


def test_resets_mid_request_under_load_leave_the_engine_serving(
        servers: tuple[LiveServer, LiveServer], slow_model: Path) -> None:
    engine, gateway = servers
    base = slow_model.name
    rng = random.Random(1234)
    busy_results: list[tuple[int, int]] = []
    stop = threading.Event()

    def keep_busy(model: str) -> None:
        while not stop.is_set():
            busy_results.append(_stream_text(gateway.url, _body(model, LONG_PROMPT, 8)))

    busy = [threading.Thread(target=keep_busy, args=(m,)) for m in (base, "a0")]
    for thread in busy:
        thread.start()
    try:
        hangups = []
        for i in range(HANGUPS):
            model = "a0" if i % 2 else base
            prompt = [5 + (i * 7 + j) % 400 for j in range(rng.randint(40, 600))]
            hangups.append(threading.Thread(target=_reset_after, args=(
                gateway.url, _body(model, prompt, 64), rng.uniform(0.02, 0.6))))
            hangups[-1].start()
            time.sleep(rng.uniform(0.0, 0.05))
        for thread in hangups:
            thread.join()
    finally:
        stop.set()
        for thread in busy:
            thread.join()

    assert engine.process.poll() is None
    assert httpx.get(engine.url + "/health").json()["status"] == "ready"
    assert busy_results and all(status == 200 for status, _ in busy_results)
    wait_engines_idle(engine.url)
    state = httpx.get(engine.url + "/state").json()
    assert state["kv_blocks_used"] == 0
    assert all(a["running_requests"] == 0 for a in state["adapters"])
    # Still serving everyone, with the adapter too.
    for model in (base, "a0"):
        assert _stream_text(gateway.url, _body(model, [5, 6, 7], 4))[0] == 200


def test_serve_restarts_an_engine_that_dies(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    serve = _spawn(["serve", "--model", str(tiny_model_dir), "--port", str(port),
                    "--poll-interval-s", "0.2", "--num-kv-blocks", "64", "--engine-process"],
                   tmp_path / "serve.log", port)
    try:
        serve.wait_ready()
        body = {"model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(serve.url + "/v1/completions", json=body, timeout=60).status_code \
            == 200
        children = _engine_children(serve.process.pid)
        assert len(children) == 1
        os.kill(children[0], signal.SIGKILL)
        # The gateway notices (503 or an ejected instance), the supervisor restarts it and
        # the gateway takes it back.
        poll(lambda: _engine_children(serve.process.pid) not in ([], children) or None,
             "a new engine process", timeout_s=60)
        poll(lambda: httpx.get(serve.url + "/health").status_code == 200 or None,
             "the gateway ready again", timeout_s=120)
        response = httpx.post(serve.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert "restarted (restart 1)" in serve.log()
    finally:
        serve.stop()


def _engine_children(pid: int) -> list[int]:
    """Pids of the `loragate engine` children of a serve process."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"engine.http" in cmdline:
            children.append(int(entry.name))
    return sorted(children)
