"""Real Redis for tests: the server at REDIS_URL (default 127.0.0.1:6379), or a private
redis-server this module starts on a free port (needed where a test stops and restarts it).

Without CI, a test that needs Redis and finds none is skipped; with CI=true it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from gateway.serve import free_port

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"Redis is required in CI: {reason}")
    pytest.skip(reason)


def shared_redis_url() -> str:
    """REDIS_URL if it answers PING (else skip, or fail in CI)."""
    url = os.environ.get("REDIS_URL", DEFAULT_URL)
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        unavailable(f"no Redis at {url}: {exc}")
    return url


@dataclass
class PrivateRedis:
    """A redis-server child process on its own port; its append-only file in workdir keeps
    the data across a stop and start, as a production Redis would."""

    port: int
    workdir: Path
    process: subprocess.Popen[bytes] | None = None
    password: str | None = None
    """Set: the server requires it (AUTH), and url carries it."""

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            unavailable("redis-server is not installed")
        assert binary is not None
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir),
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=0.2).ping()
                return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None


def private_redis(workdir: Path, password: str | None = None) -> PrivateRedis:
    return PrivateRedis(free_port(), workdir, password=password).start()
