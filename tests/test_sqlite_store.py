"""SqliteStore, the default store of a gateway without Redis: its records and version
survive a restart, one gateway holds its file (through links too), and a write the file
refuses is undone in memory. (What every store shares is tested in tests/test_store.py.)"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gateway.sqlite_store import SqliteStore
from gateway.store import StoreUnavailable
from gateway.tenancy import AdapterRecord, ApiKey, Tenant, hash_key
from tests.test_store import run


def test_sqlite_store_keeps_records_and_version_across_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    tenant = Tenant("acme", "Acme", rpm=10)
    other = Tenant("beta")
    key = ApiKey(hash_key("secret"), "acme", "k1", 123.0)
    owned = AdapterRecord("bot", "/adapters/bot", owner="acme", owner_uid=tenant.uid)
    shared = AdapterRecord("pub", "/adapters/pub", owner="beta", shared_with=("acme",),
                           owner_uid=other.uid)

    async def first() -> int:
        store = SqliteStore(path)
        for t in (tenant, other):
            assert await store.swap_tenant(t.tenant_id, None, t)
        assert await store.put_key(key)
        assert await store.swap_adapter(owned.name, None, owned)
        assert await store.swap_adapter(shared.name, None, shared)
        assert await store.put_key(ApiKey(hash_key("gone"), "beta", "k2", 1.0))
        await store.delete_key(hash_key("gone"))
        version = await store.version()
        await store.close()
        return version

    async def second(version: int) -> None:
        store = SqliteStore(path)
        snap = await store.snapshot()
        assert snap.version == version
        assert snap.tenants == {"acme": tenant, "beta": other}
        assert snap.keys == {key.key_hash: key}
        assert snap.adapters == {"bot": owned, "pub": shared}
        assert await store.delete_tenant("acme", tenant.uid) == ["bot"]
        await store.close()

    async def third() -> None:
        store = SqliteStore(path)
        snap = await store.snapshot()
        assert snap.tenants == {"beta": other} and snap.keys == {}
        assert snap.adapters == {"pub": AdapterRecord("pub", "/adapters/pub", owner="beta",
                                                      owner_uid=other.uid)}
        await store.close()

    run(second(run(first())))
    run(third())


def test_sqlite_store_refuses_a_second_gateway_on_its_file(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store = SqliteStore(path)
    with pytest.raises(ValueError, match="in use by another gateway"):
        SqliteStore(path)
    run(store.close())
    run(SqliteStore(path).close())  # free again once closed


def test_sqlite_store_lock_holds_through_links(tmp_path: Path) -> None:
    path = tmp_path / "real" / "state.db"
    store = SqliteStore(str(path))
    (tmp_path / "file-link.db").symlink_to(path)
    (tmp_path / "dir-link").symlink_to(tmp_path / "real")
    (tmp_path / "hard-link.db").hardlink_to(path)
    for other in (tmp_path / "file-link.db", tmp_path / "dir-link" / "state.db",
                  tmp_path / "hard-link.db"):
        with pytest.raises(ValueError, match=f"the state file {other} is in use"):
            SqliteStore(str(other))
    run(store.close())


def test_sqlite_store_undoes_a_write_the_file_refuses(tmp_path: Path) -> None:
    path = tmp_path / "state.db"

    async def scenario() -> None:
        store = SqliteStore(str(path))
        assert await store.swap_tenant("acme", None, Tenant("acme"))
        # Another writer holds the file's write lock: the next write fails fast.
        blocker = sqlite3.connect(str(path), timeout=0)
        blocker.execute("BEGIN IMMEDIATE")
        store._db.execute("PRAGMA busy_timeout = 0")
        with pytest.raises(StoreUnavailable, match="state file"):
            assert await store.swap_tenant("beta", None, Tenant("beta"))
        blocker.rollback()
        blocker.close()
        snap = await store.snapshot()
        assert set(snap.tenants) == {"acme"} and snap.version == 1
        await store.close()

    run(scenario())
