"""What an operator sees of a running gateway in front of one live engine: state that
survives a restart without Redis, a delete left pending finished by the next gateway, the
access log and shutdown line, and /docs that needs no network. How `loragate serve` starts
and stops its engines is in test_serve_lifecycle_live.py."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.sqlite_store import SqliteStore
from tests.live_http import poll
from tests.live_servers import LiveServer, start_engine, start_gateway

ADMIN = "ops-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tiny_adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("ops-engine")
    server = start_engine(tiny_model_dir, root, "--adapter-root",
                          str(tiny_adapters["a0"].parent))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def gateway(tiny_model_dir: Path, engine: LiveServer, log_dir: Path, *extra: str
            ) -> LiveServer:
    return start_gateway(tiny_model_dir, [engine.url], log_dir, "--admin-key", ADMIN,
                         "--state-refresh-s", "0.1", *extra).wait_ready()


def complete(url: str, key: str, model: str, stream: bool = False) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60.0,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": "hello", "max_tokens": 4,
                            "temperature": 0, "ignore_eos": True, "stream": stream})


def make_tenant(url: str, tenant_id: str, adapter_path: Path) -> str:
    """A tenant owning adapter "<tenant_id>-bot"; returns a fresh key."""
    assert httpx.post(url + "/admin/tenants", headers=AUTH, timeout=30.0,
                      json={"tenant_id": tenant_id}).status_code == 201
    key = httpx.post(url + f"/admin/tenants/{tenant_id}/keys", headers=AUTH, timeout=30.0)
    assert key.status_code == 201
    adapter = httpx.post(url + "/admin/adapters", headers=AUTH, timeout=60.0,
                         json={"name": f"{tenant_id}-bot", "path": str(adapter_path),
                               "owner": tenant_id})
    assert adapter.status_code == 201, adapter.text
    return str(key.json()["key"])


def test_tenants_keys_and_adapters_survive_a_restart_without_redis(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path], engine: LiveServer,
        tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    first = gateway(tiny_model_dir, engine, tmp_path, "--state-path", str(state))
    try:
        key = make_tenant(first.url, "acme", tiny_adapters["a0"])
        assert complete(first.url, key, "acme-bot").status_code == 200
    finally:
        assert first.stop() == 0
    second = gateway(tiny_model_dir, engine, tmp_path, "--state-path", str(state))
    try:
        tenant = httpx.get(second.url + "/admin/tenants/acme", headers=AUTH, timeout=30.0)
        assert tenant.status_code == 200
        adapter = httpx.get(second.url + "/admin/adapters/acme-bot", headers=AUTH,
                            timeout=30.0)
        assert adapter.status_code == 200 and adapter.json()["owner"] == "acme"
        response = complete(second.url, key, "acme-bot")
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        models = httpx.get(second.url + "/v1/models", timeout=30.0,
                           headers={"Authorization": f"Bearer {key}"}).json()
        assert "acme-bot" in [m["id"] for m in models["data"]]
    finally:
        second.stop()


def test_a_pending_delete_is_finished_by_the_gateway_that_restarts(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path], engine: LiveServer,
        tmp_path: Path) -> None:
    # A gateway that died mid-delete leaves the record hidden ("deleting") and the adapter
    # loaded on the engine: the next gateway on the same state unloads it and frees the name.
    state = tmp_path / "state.db"
    first = gateway(tiny_model_dir, engine, tmp_path, "--state-path", str(state))
    try:
        make_tenant(first.url, "gamma", tiny_adapters["a0"])
    finally:
        assert first.stop() == 0

    async def mark_deleting() -> None:
        store = SqliteStore(str(state))
        try:
            record = (await store.snapshot()).adapters["gamma-bot"]
            assert await store.swap_adapter("gamma-bot", record,
                                            dataclasses.replace(record, deleting=True))
        finally:
            await store.close()

    asyncio.run(mark_deleting())
    assert "gamma-bot" in [a["name"] for a in httpx.get(engine.url + "/adapters").json()]
    second = gateway(tiny_model_dir, engine, tmp_path, "--state-path", str(state))
    try:
        poll(lambda: httpx.get(second.url + "/admin/adapters/gamma-bot", headers=AUTH,
                               timeout=30.0).status_code == 404,
             "the restarted gateway to finish the pending delete")
        assert "gamma-bot" not in [a["name"] for a in
                                   httpx.get(engine.url + "/adapters").json()]
    finally:
        assert second.stop() == 0


def test_command_line_adapters_exist_while_they_are_given(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path], engine: LiveServer,
        tmp_path: Path) -> None:
    # Restarted on the same state with other --lora flags: a name no longer given is gone
    # from /v1/models and unloaded from the engine, a name given another path moves, and an
    # admin's change of who may use it stands.
    state = tmp_path / "state.db"
    first = gateway(tiny_model_dir, engine, tmp_path, "--state-path", str(state),
                    "--lora", f"kept={tiny_adapters['a0']}",
                    "--lora", f"dropped={tiny_adapters['a1']}")
    try:
        assert complete(first.url, ADMIN, "dropped").status_code == 200  # loaded on the engine
        assert httpx.post(first.url + "/admin/tenants", headers=AUTH, timeout=30.0,
                          json={"tenant_id": "acme"}).status_code == 201
        assert httpx.patch(first.url + "/admin/adapters/kept", headers=AUTH, timeout=30.0,
                           json={"owner": "acme"}).status_code == 200
    finally:
        assert first.stop() == 0
    assert "dropped" in [a["name"] for a in httpx.get(engine.url + "/adapters").json()]
    second = gateway(tiny_model_dir, engine, tmp_path, "--state-path", str(state),
                     "--lora", f"kept={tiny_adapters['a1']}")
    try:
        poll(lambda: httpx.get(second.url + "/admin/adapters/dropped", headers=AUTH,
                               timeout=30.0).status_code == 404,
             "the restarted gateway to delete the adapter it is no longer given")
        assert "dropped" not in [a["name"] for a in
                                 httpx.get(engine.url + "/adapters").json()]
        models = httpx.get(second.url + "/v1/models", headers=AUTH, timeout=30.0).json()
        assert {m["id"] for m in models["data"]} >= {"kept"} and "dropped" not in {
            m["id"] for m in models["data"]}
        kept = httpx.get(second.url + "/admin/adapters/kept", headers=AUTH, timeout=30.0)
        assert (kept.json()["path"], kept.json()["owner"]) == (str(tiny_adapters["a1"]),
                                                               "acme")
        assert complete(second.url, ADMIN, "dropped").status_code == 404
    finally:
        assert second.stop() == 0
    assert f"adapter kept: now served from {tiny_adapters['a1']}" in second.log()
    assert ("adapters given on an earlier start's command line and not on this one are "
            "deleted: dropped") in second.log()


def test_access_log_has_a_line_per_request_and_shutdown_says_what_drains(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path], engine: LiveServer,
        tmp_path: Path) -> None:
    server = gateway(tiny_model_dir, engine, tmp_path)  # in memory (tests/conftest.py)
    try:
        key = make_tenant(server.url, "beta", tiny_adapters["a0"])
        assert complete(server.url, key, "beta-bot").status_code == 200
        streamed = complete(server.url, key, "beta-bot", stream=True)
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert complete(server.url, "lg-wrong", "beta-bot").status_code == 401
        assert httpx.post(server.url + "/v1/completions", json={"prompt": 5}, timeout=30.0,
                          headers={"Authorization": f"Bearer {key}"}).status_code == 400
    finally:
        assert server.stop() == 0
    log = server.log()
    line = (r"loragate\.access: POST /v1/completions 200 tenant=beta adapter=beta-bot "
            r"prompt_tokens=\d+ completion_tokens=4 ttft_ms=\d+\.\d duration_ms=\d+\.\d "
            r"request_id=gw-[0-9a-f]{32}\n")
    assert len(re.findall(line, log)) == 2, log[-3000:]  # the whole one and the stream
    assert re.search(r"loragate\.access: POST /v1/completions 400 tenant=beta adapter=- ",
                     log)  # refused for its body: after the key was known
    assert re.search(r"loragate\.access: POST /v1/completions 401 tenant=- adapter=- "
                     r"prompt_tokens=- completion_tokens=- ttft_ms=- duration_ms=", log)
    assert re.search(r"shutting down: the gateway drains \(no new requests; 0 in flight, "
                     r"waiting up to 30s for them\)", log)
    assert "lg-wrong" not in log  # keys never reach the log


def test_docs_need_no_network(tiny_model_dir: Path, engine: LiveServer,
                              tmp_path: Path) -> None:
    server = gateway(tiny_model_dir, engine, tmp_path)
    try:
        page = httpx.get(server.url + "/docs", timeout=30.0)
        assert page.status_code == 200
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", page.text), page.text
        assets = re.findall(r"""['"](/docs-assets/[^'"]+)['"]""", page.text)
        assert {"/docs-assets/swagger-ui-bundle.js", "/docs-assets/swagger-ui.css"} <= set(
            assets)
        for asset in assets:
            assert httpx.get(server.url + asset, timeout=30.0).status_code == 200
        assert httpx.get(server.url + "/openapi.json", timeout=30.0).status_code == 200
        assert httpx.get(server.url + "/redoc", timeout=30.0).status_code == 404
    finally:
        server.stop()

