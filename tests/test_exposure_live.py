"""What a live gateway reveals, to whom, and how long a client may hold it (real processes).

Two gateways over one engine: `keyed` (an admin key, a metrics token, one tenant) and `open`
(no keys: the open mode, with --debug-headers, an allowed host and 1 s header, body and
write deadlines). Slow clients are raw sockets that trickle a request byte by byte.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.exposure import instance_tag
from gateway.serve import free_port
from tests.live_http import metric, poll
from tests.live_servers import LiveServer, start_engine, start_gateway

ADMIN = "exposure-admin-key"
METRICS_TOKEN = "exposure-metrics-token"
ALLOWED = "gateway.internal"
BOUND_S = 15.0
"""How long a slow client may stay connected before a test calls it stalled (the deadlines
under test are 1 s)."""
DRIP_S = 0.2


@dataclass
class Setup:
    engine: LiveServer
    keyed: LiveServer
    open: LiveServer
    tenant_key: str


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("exposure")
    engine = start_engine(tiny_model_dir, root, "--num-kv-blocks", "128")
    keyed = start_gateway(tiny_model_dir, [engine.url], root, "--admin-key", ADMIN,
                          "--metrics-token", METRICS_TOKEN, "--state-refresh-s", "0.1")
    open_ = start_gateway(tiny_model_dir, [engine.url], root, "--debug-headers", "true",
                          "--allowed-hosts", ALLOWED, "--header-read-timeout-s", "1",
                          "--body-read-timeout-s", "1", "--write-timeout-s", "1")
    try:
        for server in (engine, keyed, open_):
            server.wait_ready()
        created = httpx.post(keyed.url + "/admin/tenants", json={"tenant_id": "acme"},
                             headers=auth(ADMIN), timeout=10.0)
        assert created.status_code == 201, created.text
        key = httpx.post(keyed.url + "/admin/tenants/acme/keys", headers=auth(ADMIN),
                         timeout=10.0).json()["key"]
        poll(lambda: httpx.get(keyed.url + "/v1/models", headers=auth(key),
                               timeout=10.0).status_code == 200, "the tenant key to work")
        yield Setup(engine, keyed, open_, key)
    finally:
        for server in (keyed, open_, engine):
            server.stop()


def complete(url: str, key: str | None = None, **headers: str) -> httpx.Response:
    base = httpx.get(url + "/v1/models", headers={**(auth(key) if key else {}), **headers},
                     timeout=10.0).json()["data"][0]["id"]
    return httpx.post(url + "/v1/completions", timeout=60.0,
                      headers={**(auth(key) if key else {}), **headers},
                      json={"model": base, "prompt": "hi", "max_tokens": 2})


# -------------------------------------------------------------- operator endpoints
@pytest.mark.parametrize("path", ["/instances", "/metrics"])
def test_operator_endpoints_need_the_admin_key_once_keys_exist(setup: Setup,
                                                               path: str) -> None:
    def status(key: str | None) -> int:
        return httpx.get(setup.keyed.url + path, headers=auth(key) if key else {},
                         timeout=10.0).status_code

    assert [status(None), status(setup.tenant_key), status("guess"), status(ADMIN)] == [
        401, 401, 401, 200]
    assert status(METRICS_TOKEN) == (200 if path == "/metrics" else 401)
    refused = httpx.get(setup.keyed.url + path, headers=auth(setup.tenant_key), timeout=10.0)
    assert refused.json()["error"]["code"] == "invalid_api_key"
    # The open mode (no admin key, no tenant) keeps them open.
    assert httpx.get(setup.open.url + path, timeout=10.0).status_code == 200


def test_responses_name_the_instance_by_an_opaque_id_only(setup: Setup) -> None:
    response = complete(setup.keyed.url, setup.tenant_key)
    assert response.status_code == 200, response.text
    listed = httpx.get(setup.keyed.url + "/instances", headers=auth(ADMIN), timeout=10.0)
    (instance,) = listed.json()
    assert response.headers["x-loragate-instance"] == instance["public_id"] == instance_tag(
        setup.engine.url, ADMIN)
    assert "x-loragate-route" not in response.headers
    for name, value in response.headers.items():
        assert "127.0.0.1" not in value and "http" not in value, (name, value)
    # --debug-headers: the route, for benchmarks and debugging.
    debug = complete(setup.open.url)
    assert debug.headers["x-loragate-instance"] == instance_tag(setup.engine.url)
    assert debug.headers["x-loragate-route"].startswith(
        f"instance={setup.engine.url} reason=only_candidate ")


# ------------------------------------------------------------------ Host (rebinding)
def test_open_mode_answers_only_loopback_and_allowed_hosts(setup: Setup) -> None:
    port = setup.open.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}"):
        refused = httpx.get(setup.open.url + "/v1/models", headers={"Host": host},
                            timeout=10.0)
        assert refused.status_code == 400, host
        assert refused.json()["error"]["code"] == "host_not_allowed"
        posted = httpx.post(setup.open.url + "/v1/completions", headers={"Host": host},
                            json={"model": "x", "prompt": "hi"}, timeout=10.0)
        assert posted.status_code == 400, host
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost",
                 f"{ALLOWED}:{port}"):
        assert complete(setup.open.url, Host=host).status_code == 200, host
    # With keys, any Host (no --allowed-hosts given there).
    assert complete(setup.keyed.url, setup.tenant_key, Host="evil.example").status_code == 200


# ---------------------------------------------------------------------- slow clients
def connect(server: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.settimeout(DRIP_S)
    return sock


def drip_until_closed(sock: socket.socket, drip: bytes) -> bytes:
    """Send one byte of drip (cycled) whenever the server has been quiet for DRIP_S, until
    it closes the connection; return what it sent. AssertionError after BOUND_S."""
    received = b""
    deadline = time.monotonic() + BOUND_S
    sent = 0
    with sock:
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                if drip:
                    try:
                        sock.sendall(drip[sent % len(drip):][:1])
                        sent += 1
                    except OSError:  # closed under the write: the answer came before
                        pass
                continue
            except ConnectionResetError:
                return received
            if not data:
                return received
            received += data
    raise AssertionError(f"connection still open after {BOUND_S}s of trickling "
                         f"({sent} bytes); it answered {received[:200]!r}")


def parse_answer(answer: bytes) -> tuple[int, dict[str, Any]]:
    """Status code and OpenAI-style error of one raw HTTP/1.1 response (a body with a
    Content-Length)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def request_head(server: LiveServer, method: str, path: str, *extra: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{server.url.rsplit(':', 1)[1]}",
             *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_trickled_bodies_get_408_while_other_requests_run(setup: Setup) -> None:
    tricklers = []
    for _ in range(8):
        sock = connect(setup.open)
        sock.sendall(request_head(setup.open, "POST", "/v1/completions",
                                  "Content-Type: application/json", "Content-Length: 4000")
                     + b'{"model": ')
        tricklers.append(sock)
    assert complete(setup.open.url).status_code == 200  # meanwhile, a normal request
    for sock in tricklers:
        status, error = parse_answer(drip_until_closed(sock, b" "))
        assert (status, error["type"]) == (408, "timeout_error"), error


def test_a_client_that_leaves_mid_body_is_counted_as_closed(setup: Setup) -> None:
    """Not a 400 for a body that could not be read, nor a 500 for an upload cut short: the
    client left (499, as nginx logs it)."""
    def closed() -> float:
        text = httpx.get(setup.keyed.url + "/metrics", headers=auth(METRICS_TOKEN),
                         timeout=10).text
        return sum(metric(text, "loragate_gateway_responses_total", route=route,
                          status="499", code="client_closed")
                   for route in ("/v1/completions", "/admin/adapters/upload"))

    before = closed()
    for path, key in (("/v1/completions", setup.tenant_key),
                      ("/admin/adapters/upload?name=cut&public=true", ADMIN)):
        sock = connect(setup.keyed)
        sock.sendall(request_head(setup.keyed, "POST", path, f"Authorization: Bearer {key}",
                                  "Content-Type: application/json", "Content-Length: 4000")
                     + b'{"model": ')
        sock.close()  # mid-body: the headers are whole, so the request reaches its route
    poll(lambda: closed() == before + 2, "both hang-ups to be counted as 499")
    text = httpx.get(setup.keyed.url + "/metrics", headers=auth(METRICS_TOKEN), timeout=10).text
    assert metric(text, "loragate_gateway_responses_total", status="500") == 0


def refused_unrouted(setup: Setup, status: int, code: str) -> float:
    """Answers sent before any route saw the request, as /metrics counts them."""
    return metric(httpx.get(setup.open.url + "/metrics", timeout=10).text,
                  "loragate_gateway_responses_total", route="unmatched", status=str(status),
                  code=code)


def test_trickled_or_missing_headers_are_cut_off(setup: Setup) -> None:
    before = refused_unrouted(setup, 408, "request_timeout")
    trickled = connect(setup.open)
    trickled.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert parse_answer(drip_until_closed(trickled, b"X-Slow: yes\r\n")) == (408, {
        "message": "request headers not received within 1 s", "type": "timeout_error",
        "param": None, "code": "request_timeout"})
    silent = connect(setup.open)  # connects, never sends a byte
    assert parse_answer(drip_until_closed(silent, b""))[0] == 408
    assert complete(setup.open.url).status_code == 200
    assert refused_unrouted(setup, 408, "request_timeout") == before + 2


def test_an_endless_header_gets_431_and_the_connection_closed(setup: Setup) -> None:
    before = refused_unrouted(setup, 431, "headers_too_large")
    sock = connect(setup.open)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 70_000)
    assert parse_answer(drip_until_closed(sock, b"a")) == (431, {
        "message": "request headers over 65536 bytes", "type": "invalid_request_error",
        "param": None, "code": "headers_too_large"})
    assert complete(setup.open.url).status_code == 200
    assert refused_unrouted(setup, 431, "headers_too_large") == before + 1


def test_a_large_header_block_in_one_read_gets_431(setup: Setup) -> None:
    """The cap holds for a header block that arrives whole (it is counted as parsed), not
    only for one that keeps coming."""
    sock = connect(setup.open)
    sock.sendall(request_head(setup.open, "GET", "/v1/models", *(
        f"X-Pad-{i}: {'a' * 1000}" for i in range(70))))
    assert parse_answer(drip_until_closed(sock, b""))[0] == 431
    assert complete(setup.open.url).status_code == 200


def test_a_request_that_is_not_http_gets_an_openai_style_400(setup: Setup) -> None:
    sock = connect(setup.open)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n")
    assert parse_answer(drip_until_closed(sock, b"")) == (400, {
        "message": "Invalid HTTP request received.", "type": "invalid_request_error",
        "param": None, "code": "invalid_http_request"})


def test_an_early_answer_closes_a_connection_whose_body_is_still_coming(setup: Setup
                                                                        ) -> None:
    """The route answers (401) without reading the body: the connection closes instead of
    reading, and discarding, whatever the client trickles after."""
    sock = connect(setup.keyed)
    sock.sendall(request_head(setup.keyed, "GET", "/instances", "Content-Length: 100000")
                 + b"xx")
    answer = drip_until_closed(sock, b"x")
    assert parse_answer(answer)[0] == 401
    assert b"\r\nconnection: close\r\n" in answer.lower()


def test_a_client_that_reads_nothing_of_its_stream_is_dropped(setup: Setup) -> None:
    """A stream whose client stops reading fills the socket, then the gateway's buffer: after
    --write-timeout-s of nothing read the connection is dropped, so the request ends instead
    of holding its output for as long as the socket stays open."""
    base = httpx.get(setup.open.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = json.dumps({"model": base, "prompt": "hello " * 200, "max_tokens": 16, "n": 16,
                       "stream": True, "echo": True, "logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(setup.open.url.rsplit(":", 1)[1])))
    sock.sendall(request_head(setup.open, "POST", "/v1/completions",
                              "Content-Type: application/json",
                              f"Content-Length: {len(body)}") + body)
    poll(lambda: "read nothing of its response for 1 s" in setup.open.log(),
         "the stalled client to be dropped", timeout_s=BOUND_S)
    sock.settimeout(DRIP_S)
    assert b"data: [DONE]" not in drip_until_closed(sock, b"")  # what was sent, then reset
    assert complete(setup.open.url).status_code == 200


@pytest.mark.parametrize("framing, code", [
    (b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", "invalid_http_request"),
    (b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
     "unsupported_transfer_encoding"),
], ids=["bad-chunk", "unknown-coding"])
def test_a_body_framed_wrong_gets_an_answer(setup: Setup, framing: bytes, code: str) -> None:
    """Not a silent close: a chunk that is not hex is a 400; a transfer coding uvicorn would
    read as plain chunked (another reading than a proxy's) is a 501. The metrics count the
    answer the client got (not a client that left)."""
    def answered() -> float:
        return metric(httpx.get(setup.open.url + "/metrics", timeout=10).text,
                      "loragate_gateway_responses_total", route="/v1/completions", code=code)

    before = answered()
    sock = connect(setup.open)
    sock.sendall(request_head(setup.open, "POST", "/v1/completions",
                              "Content-Type: application/json")[:-2] + framing)
    assert parse_answer(drip_until_closed(sock, b""))[1]["code"] == code
    poll(lambda: answered() == before + 1, f"the {code} answer to be counted")
    assert complete(setup.open.url).status_code == 200


@pytest.mark.parametrize("malformed", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\n",
], ids=["garbage", "bad-chunk"])
def test_a_malformed_request_pipelined_after_a_whole_one_is_answered_after_it(
        setup: Setup, malformed: bytes) -> None:
    """In one write: a whole request, then a malformed one (not HTTP, or a body whose chunk
    is not hex): the first is answered, then the 400 comes and the connection closes."""
    base = httpx.get(setup.open.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = json.dumps({"model": base, "prompt": "hi", "max_tokens": 2}).encode()
    sock = connect(setup.open)
    sock.sendall(request_head(setup.open, "POST", "/v1/completions",
                              "Content-Type: application/json",
                              f"Content-Length: {len(body)}") + body + malformed)
    answer = drip_until_closed(sock, b"")
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"completion_tokens":2' in answer
    assert parse_answer(answer[answer.index(b"HTTP/1.1 400 "):])[1]["code"] == \
        "invalid_http_request"


@pytest.mark.parametrize("path, head, status, code", [
    ("/v1/models", "Host: 127.0.0.1", 400, "invalid_host"),  # a second Host header
    ("/admin%2Ftenants", "", 400, "invalid_path"),
    ("/v1/chat%2fcompletions", "", 400, "invalid_path"),
    ("/v1/models/org%2Fname", "", 404, "model_not_found"),  # a model id may hold a slash
], ids=["two-hosts", "admin", "chat", "model-id"])
def test_requests_proxies_could_read_otherwise_are_refused(
        setup: Setup, path: str, head: str, status: int, code: str) -> None:
    sock = connect(setup.open)
    sock.sendall(request_head(setup.open, "GET", path, *[head] if head else []))
    answer = parse_answer(drip_until_closed(sock, b""))
    assert (answer[0], answer[1]["code"]) == (status, code), answer


def test_health_answers_head(setup: Setup) -> None:
    for server in (setup.open, setup.engine):
        answer = httpx.head(server.url + "/health", timeout=10)
        assert answer.status_code == 200 and answer.content == b""


# ---------------------------------------------------------------------- startup log
def banner_log(server: LiveServer) -> str:
    """The server's log once its ready banner is in it."""
    return poll(lambda: (lambda log: log if "listening on" in log else None)(server.log()),
                f"{server.url}'s ready banner")


def test_startup_log_and_banner_state_the_real_mode(setup: Setup) -> None:
    keyed = banner_log(setup.keyed)
    assert "admin key set, no tenants yet: only the admin key is accepted" in keyed
    assert "open mode" not in keyed
    assert '-H "Authorization: Bearer $LORAGATE_ADMIN_KEY"' in keyed
    assert ADMIN not in keyed and METRICS_TOKEN not in keyed
    open_ = banner_log(setup.open)
    assert "open mode (no API keys required)" in open_
    assert "Authorization" not in open_


# ------------------------------------------------------------------ relative --model
def test_model_dot_from_the_model_directory_serves_the_model_by_its_name(
        setup: Setup, tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--model", ".", "--port", str(port),
             "--engine", setup.engine.url],
            cwd=tiny_model_dir, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])})
    gateway = LiveServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        gateway.wait_ready()
        models = httpx.get(gateway.url + "/v1/models", timeout=10.0).json()["data"]
        assert models[0]["id"] == tiny_model_dir.name
    finally:
        gateway.stop()
