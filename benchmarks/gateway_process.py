"""The gateway as a benchmark's child process: `loragate serve --engine URL ...` on a free
loopback port, started and waited for until ready, then stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gateway.serve import EngineProcess, free_port, wait_ready


def start_gateway(model: str, engine_urls: list[str], adapters: dict[str, str],
                  log_dir: Path, *extra: str) -> EngineProcess:
    """`loragate serve --engine URL ...` as a child process, waited for until ready."""
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "--model", model,
               "--port", str(port), "--poll-interval-s", "0.2", "--state-path", "", *extra]
    for url in engine_urls:
        command += ["--engine", url]
    for name, path in adapters.items():
        command += ["--lora", f"{name}={path}"]
    return spawn_server(command, port, log_dir / f"gateway-{port}.log")


def spawn_server(command: list[str], port: int, log: Path, env: dict[str, str] | None = None,
                 ready_s: float = 120.0) -> EngineProcess:
    """A server command (listening on ``port``) as a child process logging to ``log``,
    waited for until ready; stopped if it never is."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = EngineProcess(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_ready([server], ready_s)
    except BaseException:
        stop_gateway(server)
        raise
    return server


def stop_gateway(gateway: EngineProcess) -> None:
    gateway.process.terminate()
    try:
        gateway.process.wait(30)
    except subprocess.TimeoutExpired:
        gateway.process.kill()
