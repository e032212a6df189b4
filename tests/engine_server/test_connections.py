"""The engine server's connections: the gateway's guarded protocol
(engine/http/guarded_protocol.py) bounds what a client answered early can hold."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from engine.http.guarded_protocol import LINGER_S
from tests.live_servers import LiveServer


def test_a_connection_answered_before_its_body_arrived_is_closed(engine: LiveServer) -> None:
    # GET /health needs no token. Its body announced, answered, then sent: uvicorn alone
    # kept the connection open for good (a byte arriving stops its keep-alive deadline,
    # and no later answer starts it again).
    address = urlsplit(engine.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {address.hostname}\r\n"
                     f"Content-Length: {1 << 20}\r\n\r\n".encode())
        received = sock.recv(65536)
        assert received.startswith(b"HTTP/1.1 200 "), received[:200]
        answered = time.monotonic()
        sock.sendall(b"x" * 1000)
        while sock.recv(65536):  # until the server closes
            pass
        assert time.monotonic() - answered < LINGER_S + 5
