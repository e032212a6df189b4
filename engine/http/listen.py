"""The check that the address a server is told to listen on can be bound, made before any
model loads (`loragate serve` and `loragate engine`)."""

from __future__ import annotations

import socket


def check_port_free(host: str, port: int) -> None:
    """ValueError (one line, exit status 2 from the CLI) when host:port cannot be bound:
    checked before any model loads, so a busy port costs a second, not the model's load
    time and a traceback. The test socket is closed again at once (SO_REUSEADDR, as uvicorn
    binds, so a port in TIME_WAIT still counts as free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another "
                             f"server there? pick another --port)") from None
