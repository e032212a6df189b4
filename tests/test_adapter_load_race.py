"""Adapter writes racing another gateway replica's. An adapter deleted while this gateway
loads it onto an engine for a request: the request is a 404, and the engine is left without
the adapter (no record would ever unload it). A registration that loses its name to the same
weights registered elsewhere: a 409 that leaves the winner's adapter loaded. The gateway
runs in process over a real engine; the other replica's write is made to land inside this
one's, the one place each race can happen."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from anyio.from_thread import BlockingPortal
from fastapi.testclient import TestClient

from engine.adapter_roots import AdapterRoots
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.instances import Instance
from gateway.local_engine import LocalEngine
from gateway.service import Gateway
from gateway.tenancy import AdapterRecord

ADMIN = "race-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


class Served(NamedTuple):
    client: TestClient
    gateway: Gateway
    instance: Instance
    """The in-process engine's instance."""
    portal: BlockingPortal
    """The app's event loop, where the engine client runs."""


@pytest.fixture
def served(tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> Iterator[Served]:
    """A gateway in process over a real engine that may load the tiny adapter a0."""
    local = LocalEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64),
                        AdapterRoots([tiny_adapters["a0"]]))
    app = create_app(GatewayConfig(admin_key=ADMIN, state_path=""), [], str(tiny_model_dir),
                     local=local)
    try:
        with TestClient(app) as client:
            gateway: Gateway = app.state.gateway
            assert client.portal is not None
            yield Served(client, gateway, next(iter(gateway.pool.instances.values())),
                         client.portal)
    finally:
        local.shutdown()


def test_an_adapter_deleted_while_it_loads_is_neither_served_nor_left_loaded(
        served: Served, tiny_adapters: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    client, gateway, instance, portal = served
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


def test_a_registration_that_loses_to_the_same_weights_leaves_them_loaded(
        served: Served, tiny_adapters: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    client, gateway, instance, portal = served
    path = str(tiny_adapters["a0"].resolve())
    # The winner's answer already shows where it was loaded (no poll came between).
    winner = client.post("/admin/adapters", headers=AUTH, json={
        "name": "a0", "path": path, "public": True})
    assert winner.status_code == 201, winner.text
    digest = winner.json()["digest"]
    assert [(i["registered"], i["digest"]) for i in
            winner.json()["instances"].values()] == [(True, digest)]
    assert client.delete("/admin/adapters/a0", headers=AUTH).status_code == 200

    store = gateway.view.store
    swap = store.swap_adapter

    async def another_replica_first(name: str, expected: AdapterRecord | None,
                                    new: AdapterRecord | None) -> bool:
        if expected is None and new is not None:  # the same weights, recorded there
            await swap(name, None, AdapterRecord(name, path, digest=digest))
        return await swap(name, expected, new)

    monkeypatch.setattr(store, "swap_adapter", another_replica_first)
    loser = client.post("/admin/adapters", headers=AUTH, json={
        "name": "a0", "path": path, "public": True})
    assert loser.status_code == 409, loser.text
    assert [a.name for a in portal.call(instance.client.state).adapters] == ["a0"]
    assert instance.adapters["a0"].digest == digest
    answer = client.post("/v1/completions", headers=AUTH, json={
        "model": "a0", "prompt": "hello", "max_tokens": 2})
    assert answer.status_code == 200, answer.text
