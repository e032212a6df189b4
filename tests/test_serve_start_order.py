"""`loragate serve` starts the demo adapters' training only once its checks passed: a start
refused for a held state file or a busy port says nothing of training and starts none."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from engine.config import EngineConfig
from gateway.config import GatewayConfig
from gateway.serve import free_port, serve
from gateway.sqlite_store import SqliteStore


def test_a_refused_start_never_starts_training(tiny_model_dir: Path, tmp_path: Path) -> None:
    started: list[bool] = []

    def start_training() -> bool:
        started.append(True)
        return True

    held = tmp_path / "state.db"
    holder = SqliteStore(str(held))
    engine = EngineConfig(model=str(tiny_model_dir))
    try:
        with pytest.raises(ValueError, match="in use by another gateway"):
            serve(GatewayConfig(port=free_port(), state_path=str(held)), engine, 1, [],
                  str(tiny_model_dir), {}, start_training=start_training)
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            with pytest.raises(ValueError, match="cannot listen"):
                serve(GatewayConfig(port=busy.getsockname()[1], state_path=""), engine, 1,
                      [], str(tiny_model_dir), {}, start_training=start_training)
    finally:
        asyncio.run(holder.close())
    assert started == []
