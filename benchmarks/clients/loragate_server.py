"""A `loragate serve` subprocess for a client benchmark: started on a free loopback port, ready
once GET /health answers 200, and always stopped (its whole process group) on the way out.

The server runs exactly as a user starts it, in its own process and session, so the client
under test (lm-eval) talks to it over real HTTP like to any OpenAI-compatible server. Its
state lives in memory only (``--state-path ""``): no tenant from an earlier gateway on this
machine can turn the open mode off, and the admin key (a fresh random one) is what the
client sends as its API key, which the gateway accepts as the operator's.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.serving import stop_server, wait_healthy
from gateway.serve import free_port

STARTUP_TIMEOUT_S = 300.0  # first start on a new machine compiles the CPU kernels (a minute or two)
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Server:
    """A running server: where to reach it, and the key to reach it with."""

    base_url: str
    api_key: str
    model_name: str
    log_path: Path
    startup_s: float

    def log_size(self) -> int:
        """Bytes of the server's log so far: a mark for ``completions_by_status``."""
        return self.log_path.stat().st_size

    def completions_by_status(self, since: int) -> dict[str, int]:
        """{HTTP status: count} of the POST /v1/completions the access log recorded after the
        mark ``since`` (one line per request, written when it ends)."""
        with self.log_path.open("rb") as log:
            log.seek(since)
            lines = log.read().decode(errors="replace").splitlines()
        counts: dict[str, int] = {}
        for line in lines:
            _, found, rest = line.partition("POST /v1/completions ")
            if found:
                status = rest.split(" ", 1)[0]
                counts[status] = counts.get(status, 0) + 1
        return counts


def serve_command(model_dir: Path, port: int, api_key: str, model_name: str) -> list[str]:
    """`loragate serve` for one in-process engine computing in float32, the dtype of the
    transformers reference the check compares against."""
    return [sys.executable, "-m", "gateway.cli", "serve", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--served-model-name", model_name, "--admin-key", api_key, "--state-path", ""]


@contextlib.contextmanager
def running_server(model_dir: Path, model_name: str, log_path: Path,
                   env: dict[str, str]) -> Iterator[Server]:
    """A ready server on a free port for the duration of the block, stopped afterwards even
    when the block (or the start-up) raises."""
    port, api_key = free_port(), secrets.token_urlsafe(24)
    repo_root = Path(__file__).resolve().parents[2]
    with log_path.open("wb") as log:
        process = subprocess.Popen(serve_command(model_dir, port, api_key, model_name),
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env={**env, "PYTHONUNBUFFERED": "1"},
                                   cwd=repo_root, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        startup_s = wait_healthy(process, url, log_path, STARTUP_TIMEOUT_S)
        yield Server(url, api_key, model_name, log_path, startup_s)
    finally:
        stop_server(process, STOP_TIMEOUT_S)
