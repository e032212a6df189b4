"""An adapter deleted (through another gateway replica) while this gateway loads it onto an
engine for a request: the request is a 404, and the engine is left without the adapter (no
record would ever unload it). The gateway runs in process over a real engine; the delete is
made to land inside the load, the one place the race can happen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.adapter_roots import AdapterRoots
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.local_engine import LocalEngine
from gateway.service import Gateway

ADMIN = "race-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def test_an_adapter_deleted_while_it_loads_is_neither_served_nor_left_loaded(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    local = LocalEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64),
                        AdapterRoots([tiny_adapters["a0"]]))
    app = create_app(GatewayConfig(admin_key=ADMIN, state_path=""), [], str(tiny_model_dir),
                     local=local)
    try:
        with TestClient(app) as client:
            gateway: Gateway = app.state.gateway
            instance = next(iter(gateway.pool.instances.values()))
            portal = client.portal  # the app's event loop, where the engine client runs
            assert portal is not None
            registered = client.post("/admin/adapters", headers=AUTH, json={
                "name": "a0", "path": str(tiny_adapters["a0"]), "public": True})
            assert registered.status_code == 201, registered.text

            def held() -> list[str]:
                return [a.name for a in portal.call(instance.client.state).adapters]

            assert held() == ["a0"]
            # The engine lets it go (idle), so the next request loads it again.
            portal.call(instance.client.unload_adapter, "a0")
            instance.adapters.pop("a0", None)
            load = instance.client.load_adapter

            async def deleted_meanwhile(name: str, path: str) -> Any:
                await gateway.view.store.delete_adapter(name)
                return await load(name, path)

            monkeypatch.setattr(instance.client, "load_adapter", deleted_meanwhile)
            answer = client.post("/v1/completions", headers=AUTH, json={
                "model": "a0", "prompt": "hello", "max_tokens": 2})
            assert answer.status_code == 404, answer.text
            assert answer.json()["error"]["code"] == "model_not_found"
            assert held() == []
            assert "a0" not in instance.adapters
    finally:
        local.shutdown()
