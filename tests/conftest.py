"""Shared fixtures: tiny seeded models built in temp dirs (no downloads), and the state
stores (memory and a real Redis)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from gateway.redis_store import RedisStore
from gateway.sqlite_store import STATE_PATH_ENV, SqliteStore
from gateway.store import MemoryStore, StateStore
from tests.redis_server import shared_redis_url
from tests.tiny_models import make_tiny_adapters, make_tiny_model

# Gateways started by tests (in process or as children, which inherit this) keep tenants in
# memory unless a test gives --state-path: none shares the user's ~/.cache/loragate/state.db
# or another test's file.
os.environ[STATE_PATH_ENV] = ":memory:"
# `loragate serve` without --model trains the demo adapters in the background: not in tests
# (tests/test_demo_adapters_background.py runs that training on a tiny model).
os.environ["LORAGATE_DEMO_ADAPTERS"] = "0"
# dtype="auto" runs bfloat16 on a CPU with AMX (engine/models/loader.py): tests compare with
# float32 references on every host, so engines they start (as children, which read this, or
# in process, where cpu_auto_dtype is pinned below) run float32 unless a test asks for
# another dtype; tests/test_auto_dtype.py covers the rule itself.
os.environ["LORAGATE_DTYPE"] = "float32"


@pytest.fixture(scope="session", autouse=True)
def _float32_auto_dtype() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.models.loader.cpu_auto_dtype", lambda: torch.float32)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama (hidden 64, vocab 512) with a trained BPE tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, Path]:
    """Two PEFT adapters of the tiny model: a0 (q/v, rank 8) and a1 (all seven targets)."""
    return make_tiny_adapters(tiny_model_dir, tmp_path_factory.mktemp("tiny-adapters"))


@pytest.fixture(params=["memory", "sqlite", "redis"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path
               ) -> Iterator[Callable[[], StateStore]]:
    """The store and rate-limit tests run on the in-memory store, the embedded SQLite store
    and a real Redis (a fresh key prefix, removed afterwards). A factory: every call is one
    gateway's connection to the same shared state."""
    if request.param in ("memory", "sqlite"):
        store = MemoryStore() if request.param == "memory" else \
            SqliteStore(str(tmp_path / "state.db"))
        yield lambda: store
        asyncio.run(store.close())
        return
    url = shared_redis_url()
    prefix = f"lg-test-{uuid.uuid4().hex[:8]}:"
    # A generous timeout: these tests are about shared state, and 50 concurrent first
    # connections on a loaded 2-core machine can take longer than the gateway's 0.5 s
    # fail-fast default (what a store outage does is tested with a server of their own).
    yield lambda: RedisStore(url, prefix=prefix, timeout_s=5.0)
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)
