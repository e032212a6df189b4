"""Tenant writes race other writes, as gateway replicas sharing one Redis do: the stores'
swap_tenant is a compare and set, and the admin routes built on it let no write undo
another. The HTTP tests run a gateway in process over a real Redis and make another
replica's write land between the route's read and its own write, the one place the race
can happen."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.redis_store import RedisStore
from gateway.service import Gateway
from gateway.store import Snapshot, StateStore
from gateway.tenancy import ApiKey, Tenant, hash_key
from tests.redis_server import shared_redis_url

ADMIN = "race-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def test_swap_tenant_changes_only_the_record_it_was_given(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store, other = make_store(), make_store()
        first = Tenant("acme", "Acme")
        v0 = await store.version()
        assert await store.swap_tenant("acme", None, first)
        assert not await other.swap_tenant("acme", None, Tenant("acme"))  # the id is taken
        assert await other.version() == v0 + 1  # a refusal writes nothing
        limited = dataclasses.replace(first, rpm=5)
        assert await other.swap_tenant("acme", first, limited)
        renamed = dataclasses.replace(first, name="Acme Inc")
        assert not await store.swap_tenant("acme", first, renamed)  # read before the change
        assert (await store.snapshot()).tenants == {"acme": limited}
        assert await other.delete_tenant("acme", limited.uid) == []
        assert not await store.swap_tenant("acme", limited, renamed)  # never brought back
        assert (await store.snapshot()).tenants == {}
        await store.close()
        await other.close()

    asyncio.run(scenario())


def test_one_of_many_racing_creates_takes_an_id(make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        stores = [make_store() for _ in range(4)]
        tenants = [Tenant("acme", f"try {i}") for i in range(12)]
        won = await asyncio.gather(*(stores[i % 4].swap_tenant("acme", None, t)
                                     for i, t in enumerate(tenants)))
        assert sum(won) == 1
        assert (await stores[1].snapshot()).tenants == {"acme": tenants[won.index(True)]}
        for store in stores:
            await store.close()

    asyncio.run(scenario())


def test_a_key_is_stored_only_for_the_incarnation_it_was_issued_to(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store, other = make_store(), make_store()
        old, again = Tenant("acme"), Tenant("acme")
        late = ApiKey(hash_key("late"), "acme", "k1", 0.0, old.uid)
        assert not await store.put_key(late)  # no tenant yet
        assert await store.swap_tenant("acme", None, old)
        assert await other.delete_tenant("acme", old.uid) == []
        v0 = await store.version()
        assert not await store.put_key(late)  # its tenant was deleted
        assert await store.swap_tenant("acme", None, again)
        assert not await store.put_key(late)  # nor does the next tenant of the id take it
        assert await store.version() == v0 + 1  # refusals write nothing
        assert (await other.snapshot()).keys == {}
        fresh = ApiKey(hash_key("fresh"), "acme", "k2", 0.0, again.uid)
        assert await other.put_key(fresh)
        assert (await store.snapshot()).keys == {fresh.key_hash: fresh}
        await store.close()
        await other.close()

    asyncio.run(scenario())


@dataclass
class Replica:
    client: TestClient
    gateway: Gateway
    url: str
    prefix: str

    def rival_writes_first(self, monkeypatch: pytest.MonkeyPatch,
                           write: Callable[[RedisStore], Awaitable[object]],
                           before: str = "swap_tenant") -> None:
        """Another replica's ``write`` lands just before this gateway's next call of its
        store's method ``before`` (a tenant write)."""
        store = self.gateway.view.store
        own_write = getattr(store, before)
        pending = [write]

        async def after_the_rival(*args: Any) -> Any:
            if pending:
                rival = RedisStore(self.url, prefix=self.prefix, timeout_s=5.0)
                await pending.pop()(rival)
                await rival.close()
            return await own_write(*args)

        monkeypatch.setattr(store, before, after_the_rival)

    def snapshot(self) -> Snapshot:
        """The shared state, as another replica reads it."""
        async def read() -> Snapshot:
            store = RedisStore(self.url, prefix=self.prefix, timeout_s=5.0)
            snapshot = await store.snapshot()
            await store.close()
            return snapshot

        return asyncio.run(read())

    def stored(self) -> dict[str, Tenant]:
        return self.snapshot().tenants


@pytest.fixture
def replica(tiny_model_dir: Path) -> Iterator[Replica]:
    url = shared_redis_url()
    prefix = f"lg-test-{uuid.uuid4().hex[:8]}:"
    # No engines: these tests use the admin routes only (engines would come from the registry).
    app = create_app(GatewayConfig(admin_key=ADMIN, redis_url=url, engine_token="race"), [],
                     str(tiny_model_dir), store=RedisStore(url, prefix=prefix, timeout_s=5.0))
    try:
        with TestClient(app) as client:
            yield Replica(client, app.state.gateway, url, prefix)
    finally:
        plain = redis.Redis.from_url(url)
        keys = list(plain.scan_iter(match=prefix + "*"))
        if keys:
            plain.delete(*keys)
        plain.close()


def test_the_later_of_two_creates_of_an_id_is_a_409(replica: Replica,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    rival = Tenant("acme", "created elsewhere")
    replica.rival_writes_first(monkeypatch, lambda store: store.swap_tenant("acme", None, rival))
    answer = replica.client.post("/admin/tenants", headers=AUTH,
                                 json={"tenant_id": "acme", "name": "created here"})
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["message"] == "tenant 'acme' already exists"
    assert replica.stored() == {"acme": rival}


def test_two_patches_of_different_fields_both_hold(replica: Replica,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    created = replica.client.post("/admin/tenants", headers=AUTH, json={"tenant_id": "acme"})
    assert created.status_code == 201, created.text
    before = Tenant(**created.json())

    async def limit(store: RedisStore) -> bool:
        return await store.swap_tenant("acme", before, dataclasses.replace(before, rpm=5))

    replica.rival_writes_first(monkeypatch, limit)
    answer = replica.client.patch("/admin/tenants/acme", headers=AUTH,
                                  json={"name": "Acme Inc"})
    assert answer.status_code == 200, answer.text
    both = dataclasses.replace(before, rpm=5, name="Acme Inc")
    assert Tenant(**answer.json()) == both
    assert replica.stored() == {"acme": both}


def test_a_patch_racing_a_delete_is_a_404_and_brings_nothing_back(
        replica: Replica, monkeypatch: pytest.MonkeyPatch) -> None:
    created = replica.client.post("/admin/tenants", headers=AUTH, json={"tenant_id": "acme"})
    assert created.status_code == 201, created.text
    key = replica.client.post("/admin/tenants/acme/keys", headers=AUTH)
    assert key.status_code == 201, key.text
    uid = created.json()["uid"]
    replica.rival_writes_first(monkeypatch, lambda store: store.delete_tenant("acme", uid))
    answer = replica.client.patch("/admin/tenants/acme", headers=AUTH, json={"rpm": 9})
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["message"] == "tenant 'acme' does not exist"
    assert replica.stored() == {}
    assert replica.client.get("/admin/tenants/acme", headers=AUTH).status_code == 404
    assert replica.snapshot().keys == {}  # its key went with it


def test_a_delete_leaves_a_tenant_created_again_since_it_read(
        replica: Replica, monkeypatch: pytest.MonkeyPatch) -> None:
    created = replica.client.post("/admin/tenants", headers=AUTH, json={"tenant_id": "acme"})
    assert created.status_code == 201, created.text
    old = Tenant(**created.json())
    again = Tenant("acme", "created again")
    again_key = ApiKey(hash_key("sk-again"), "acme", "k-again", 0.0, again.uid)

    async def delete_and_create_again(store: RedisStore) -> None:
        assert await store.delete_tenant("acme", old.uid) == []
        assert await store.swap_tenant("acme", None, again)
        assert await store.put_key(again_key)

    replica.rival_writes_first(monkeypatch, delete_and_create_again, before="delete_tenant")
    answer = replica.client.delete("/admin/tenants/acme", headers=AUTH)
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["message"] == "tenant 'acme' was deleted meanwhile"
    assert replica.stored() == {"acme": again}
    assert replica.snapshot().keys == {again_key.key_hash: again_key}


@pytest.mark.parametrize("created_again", [False, True])
def test_a_key_issued_while_its_tenant_is_deleted_is_a_404_and_stored_nowhere(
        replica: Replica, monkeypatch: pytest.MonkeyPatch, created_again: bool) -> None:
    created = replica.client.post("/admin/tenants", headers=AUTH, json={"tenant_id": "acme"})
    assert created.status_code == 201, created.text
    again = Tenant("acme", "created again")

    async def delete(store: RedisStore) -> None:
        assert await store.delete_tenant("acme", created.json()["uid"]) == []
        if created_again:
            assert await store.swap_tenant("acme", None, again)

    replica.rival_writes_first(monkeypatch, delete, before="put_key")
    answer = replica.client.post("/admin/tenants/acme/keys", headers=AUTH)
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["message"] == "tenant 'acme' was deleted meanwhile"
    assert "key" not in answer.json()
    assert replica.stored() == ({"acme": again} if created_again else {})
    assert replica.snapshot().keys == {}


def test_rotating_a_key_replaces_it_and_revoking_removes_it(replica: Replica) -> None:
    assert replica.client.post("/admin/tenants", headers=AUTH,
                               json={"tenant_id": "acme"}).status_code == 201
    first = replica.client.post("/admin/tenants/acme/keys", headers=AUTH).json()
    rotated = replica.client.post(f"/admin/tenants/acme/keys/{first['key_id']}/rotate",
                                  headers=AUTH)
    assert rotated.status_code == 201, rotated.text
    second = rotated.json()
    assert second["key"] != first["key"] and second["tenant_id"] == "acme"
    assert [k.key_hash for k in replica.snapshot().keys.values()] == [hash_key(second["key"])]
    again = replica.client.post(f"/admin/tenants/acme/keys/{first['key_id']}/rotate",
                                headers=AUTH)
    assert again.status_code == 404, again.text
    revoked = replica.client.delete(f"/admin/tenants/acme/keys/{second['key_id']}",
                                    headers=AUTH)
    assert revoked.json() == {"key_id": second["key_id"], "status": "revoked"}
    assert replica.snapshot().keys == {}
