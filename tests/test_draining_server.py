"""DrainingServer on its own: a real uvicorn server over a minimal ASGI app."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import uvicorn
from starlette.types import Receive, Scope, Send

from engine.http.draining import DrainingServer


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


def test_a_port_taken_after_the_check_stops_the_server_without_exiting() -> None:
    # Bound between the early port check and the bind (another process was quicker):
    # uvicorn would exit the process from inside the event loop, with a traceback and
    # the caller's cleanup (engines started, temp files) skipped.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = DrainingServer(uvicorn.Config(_app, host="127.0.0.1", port=port,
                                               log_level="critical"), drain_timeout_s=1.0)
        server.run()  # returns: no SystemExit
    assert not server.started


def test_serves_signals_are_ignored_once_its_cleanup_began() -> None:
    from gateway.stop_signals import StoppedWhileStarting, StopSignals

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with StopSignals() as signals:  # starting: a stop raises, so the cleanup runs
            try:
                signal.raise_signal(signal.SIGTERM)
            except StoppedWhileStarting as stop:
                assert str(stop) == "SIGTERM"
            signals.stopping = True
            signal.raise_signal(signal.SIGTERM)  # cleaning up: changes nothing
        # Exiting: the kernel ignores them, as the interpreter's shutdown would otherwise
        # reset Python's handlers to the default (a late SIGTERM killing a clean exit).
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_the_startup_heap_is_frozen_once_the_server_listens() -> None:
    # In a child process: a freeze lasts as long as the process, which pytest's must not.
    code = textwrap.dedent("""
        import gc, uvicorn, weakref
        from engine.http.draining import DrainingServer
        from tests.test_draining_server import _app
        server = DrainingServer(uvicorn.Config(_app, host="127.0.0.1", port=0,
                                               log_level="critical"), drain_timeout_s=1.0)
        class Node: pass
        gc.disable()  # the cycle below stays until the freeze's own collection
        node = Node()
        node.itself = node  # a cycle nothing refers to: to be freed, not frozen
        cycle = weakref.ref(node)
        del node
        counts = [gc.get_freeze_count()]
        def listening():
            counts.append(gc.get_freeze_count())
            server.should_exit = True
        server.on_listening = listening
        server.run()
        print(*counts, int(cycle() is None))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True, cwd=Path(__file__).resolve().parents[1])
    before, listening, cycle_freed = map(int, done.stdout.split())
    # uvicorn, starlette and asyncio alone leave tens of thousands of objects for good.
    assert before == 0 and listening > 10_000 and cycle_freed == 1
