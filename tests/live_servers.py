"""Real engine and gateway processes on loopback ports, for tests of the HTTP layers.

Each server is a child process: engines `python -m engine.http ...`, exactly as `loragate
serve` starts them, gateways `python -m gateway.cli serve ...`; ready means its /health
answered 200. stop() sends SIGTERM (a graceful
drain) and kills after a timeout; kill() is the crash the fault tests need.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.serve import free_port

READY_TIMEOUT_S = 120.0


@dataclass
class LiveServer:
    """A child server process and its base URL."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> LiveServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.url} exited ({self.process.returncode}):\n"
                                   f"{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.url} not ready after {timeout_s}s:\n{self.log()[-3000:]}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful drain), then kill; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: the crash of a real process, nothing flushed or drained."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _spawn(args: list[str], log_path: Path, port: int) -> LiveServer:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    module = ["engine.http", *args[1:]] if args[0] == "engine" else ["gateway.cli", *args]
    with open(log_path, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", *module], stdout=out,
                                   stderr=subprocess.STDOUT, env=env)
    return LiveServer(f"http://127.0.0.1:{port}", process, log_path, args)


def start_engine(model_dir: Path, log_dir: Path, *extra: str,
                 adapters: dict[str, Path] | None = None, port: int | None = None,
                 instance_id: str | None = None) -> LiveServer:
    """`loragate engine` on a free port (not yet waited for: call wait_ready())."""
    port = port or free_port()
    args = ["engine", "--model", str(model_dir), "--port", str(port),
            "--instance-id", instance_id or f"engine-{port}", *extra]
    for name, path in (adapters or {}).items():
        args += ["--lora", f"{name}={path}"]
    return _spawn(args, log_dir / f"engine-{port}.log", port)


def start_gateway(model_dir: Path, engine_urls: list[str], log_dir: Path, *extra: str,
                  adapters: dict[str, Path] | None = None) -> LiveServer:
    """`loragate serve --engine URL ...` (the gateway alone, attached to running engines)."""
    port = free_port()
    args = ["serve", "--model", str(model_dir), "--port", str(port), "--poll-interval-s",
            "0.2", *extra]
    for url in engine_urls:
        args += ["--engine", url]
    for name, path in (adapters or {}).items():
        args += ["--lora", f"{name}={path}"]
    return _spawn(args, log_dir / f"gateway-{port}.log", port)


def start_serve(log_dir: Path, *extra: str) -> LiveServer:
    """`loragate serve` with its own local engine instance(s): the command a user runs."""
    port = free_port()
    args = ["serve", "--port", str(port), "--poll-interval-s", "0.2", *extra]
    return _spawn(args, log_dir / f"serve-{port}.log", port)


@contextlib.contextmanager
def running(*servers: LiveServer) -> Iterator[None]:
    """Wait until every server is ready (in order), and stop them all afterwards, the last
    started first, whatever happened in between."""
    try:
        for server in servers:
            server.wait_ready()
        yield
    finally:
        for server in reversed(servers):
            server.stop()
