"""The engine server's connections under a request answered before its body arrived: the
guarded protocol (engine/http/guarded_protocol.py) keeps the connection for the client's next
request, and bounds how long that body may take. uvicorn alone kept such a connection open
for good: each byte of the body stops its keep-alive deadline, and nothing starts it again."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from engine.http.guarded_protocol import LINGER_S
from tests.engine_server.helpers import GREEDY, metric_value, wait_idle
from tests.live_servers import LiveServer

BODY_BYTES = 100_000
KEEP_ALIVE_S = 5.0  # uvicorn's default, which the engine keeps


def _connect(engine: LiveServer) -> socket.socket:
    address = urlsplit(engine.url)
    assert address.hostname is not None and address.port is not None
    return socket.create_connection((address.hostname, address.port), timeout=30)


def _health_request(body_bytes: int) -> bytes:
    # GET /health needs no token and reads no body: it is answered as soon as its headers are.
    return f"GET /health HTTP/1.1\r\nHost: engine\r\nContent-Length: {body_bytes}\r\n\r\n".encode()


def _generate_request(padding: int = 0, params: Mapping[str, object] = GREEDY) -> bytes:
    body = json.dumps({"prompt": "one two three", "params": params, "stream": False}).encode()
    body = body.ljust(len(body) + padding)  # JSON allows the trailing spaces
    return (b"POST /generate HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def _read_response(sock: socket.socket) -> bytes:
    """One response's head, its body read and dropped. It reads no byte past that response:
    a second one that came in the same segment (a late first answer) stays for the next call."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        assert byte, f"closed before a response: {head!r}"
        head += byte
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while length:
        chunk = sock.recv(length)
        assert chunk, "closed inside a response"
        length -= len(chunk)
    return head.removesuffix(b"\r\n\r\n")


def _seconds_until_closed(sock: socket.socket) -> float:
    start = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - start


def test_the_connection_serves_the_next_request_then_times_out(engine: LiveServer) -> None:
    with _connect(engine) as sock:
        sock.sendall(_health_request(BODY_BYTES))
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"x" * BODY_BYTES)  # the body, after its answer
        sock.sendall(_health_request(0))
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        assert _seconds_until_closed(sock) < KEEP_ALIVE_S + 5


def test_an_answered_body_that_ends_restarts_the_keep_alive_deadline(
        engine: LiveServer) -> None:
    with _connect(engine) as sock:
        sock.sendall(_health_request(BODY_BYTES))
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"x" * BODY_BYTES)
        assert _seconds_until_closed(sock) < KEEP_ALIVE_S + 5


def test_an_answered_body_that_trickles_is_cut_off(engine: LiveServer) -> None:
    with _connect(engine) as sock:
        sock.sendall(_health_request(BODY_BYTES))
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        answered = time.monotonic()
        try:
            while time.monotonic() - answered < LINGER_S + 10:
                sock.sendall(b"x")
                sock.settimeout(1.0)
                try:
                    if not sock.recv(65536):
                        break  # closed
                except TimeoutError:
                    continue
        except (ConnectionResetError, BrokenPipeError):
            pass
        assert time.monotonic() - answered < LINGER_S + 5


def test_a_client_that_shuts_its_write_side_is_taken_as_gone(engine: LiveServer,
                                                              http: httpx.Client) -> None:
    # A FIN mid-request is a hang-up (as uvicorn and nginx take it): the connection closes
    # at once, unanswered, and the generation is aborted rather than run to its end (the
    # non-streamed /generate ran it whole, for nobody).
    # (A whole run of it takes this engine about 1.2 s; the client is watched every 0.25 s.)
    params = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    before = _tokens_generated(http)
    with _connect(engine) as sock:
        sock.sendall(_generate_request(params=params))
        time.sleep(0.05)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(65536) == b""
    wait_idle(http)
    assert _tokens_generated(http) - before < 900  # of 999, had it run to its end


def test_a_request_begun_in_the_read_of_a_large_body_is_not_counted_as_its_headers(
        engine: LiveServer) -> None:
    # A read holds a 70 KB body and the first bytes of the next request: counted whole as
    # that request's headers, it was over the 64 KiB cap (a false 431).
    following = _health_request(0)
    with _connect(engine) as sock:
        sock.sendall(_generate_request(padding=70_000) + following[:12])
        time.sleep(0.5)
        sock.sendall(following[12:])
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")


def test_a_malformed_chunk_in_an_answered_body_only_closes(engine: LiveServer) -> None:
    with _connect(engine) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"zz\r\nhello\r\n")  # not a chunk size
        assert sock.recv(65536) == b""  # closed, with no second answer to the one request


def test_an_answered_body_that_ends_leaves_no_socket_behind(engine: LiveServer) -> None:
    # Its request's later close (here the keep-alive deadline) is a plain close: the server
    # held the socket 5 s more, lingering for a body that had already ended.
    fds = Path(f"/proc/{engine.process.pid}/fd")
    before = len(list(fds.iterdir()))
    with _connect(engine) as sock:
        sock.sendall(_health_request(10))
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"0123456789")
        _seconds_until_closed(sock)
        deadline = time.monotonic() + 2.0  # the client keeps its end open meanwhile
        while len(list(fds.iterdir())) > before:
            assert time.monotonic() < deadline, "the server still holds the socket"
            time.sleep(0.05)


def _tokens_generated(http: httpx.Client) -> float:
    """Tokens the engine generated so far, less one per request (the gaps between them)."""
    return metric_value(http.get("/metrics").text, "loragate_inter_token_latency_seconds_count")
