"""A Redis that restarts empty (no persistence) loses what the gateways wrote at startup:
the adapters given on their command lines. The state view notices the store's version going
back and runs its reset hooks, so those adapters are served again without a gateway
restart; a normal refresh never runs them (an adapter an admin deleted stays deleted)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway.auth import StateView
from gateway.redis_store import RedisStore
from gateway.tenancy import AdapterRecord, Tenant
from tests.redis_server import private_redis


def test_startup_adapters_come_back_when_redis_restarts_empty(tmp_path: Path) -> None:
    server = private_redis(tmp_path)

    async def scenario() -> tuple[list[str], list[str], list[str], int]:
        store = RedisStore(server.url)
        view = StateView(store, refresh_s=0.1)
        calls = 0

        async def register_configured() -> None:
            nonlocal calls
            calls += 1
            for name in ("cfg-a", "cfg-b"):
                await store.swap_adapter(name, None, AdapterRecord(name, f"/adapters/{name}"))

        try:
            await register_configured()
            view.reset_hooks.append(register_configured)
            for tenant in ("t1", "t2", "t3"):  # more writes: a version well above 0
                assert await store.swap_tenant(tenant, None, Tenant(tenant))
            await view.refresh()
            before = sorted(view.snapshot.adapters)
            deleted = await store.swap_adapter("cfg-b", view.snapshot.adapters["cfg-b"], None)
            assert deleted
            await view.refresh()  # the version moved forward: no hook
            after_delete = sorted(view.snapshot.adapters)
            server.stop()
            shutil.rmtree(tmp_path / "appendonlydir")  # as a Redis that persists nothing
            server.start()
            await view.refresh()  # the first call may reconnect and fail: the next one works
            await view.refresh()
            return before, after_delete, sorted(view.snapshot.adapters), calls
        finally:
            await store.close()

    try:
        before, after_delete, after_reset, calls = asyncio.run(scenario())
    finally:
        server.stop()
    assert before == ["cfg-a", "cfg-b"] and after_delete == ["cfg-a"]
    assert after_reset == ["cfg-a", "cfg-b"] and calls == 2


def test_a_gateway_that_missed_the_restart_still_sees_the_data_is_new(tmp_path: Path) -> None:
    """Gateway x is paused through the restart; meanwhile gateway y writes its records back
    and more writes push the version past the one x saw last. x's next refresh still finds
    the store a new incarnation and writes its own startup adapter back."""
    server = private_redis(tmp_path)

    async def scenario() -> list[str]:
        stores = [RedisStore(server.url), RedisStore(server.url)]
        views = [StateView(store, refresh_s=0.1) for store in stores]

        def registering(store: RedisStore, name: str) -> Callable[[], Awaitable[None]]:
            async def register() -> None:
                await store.swap_adapter(name, None, AdapterRecord(name, f"/adapters/{name}"))
            return register

        try:
            for view, store, name in zip(views, stores, ("solo", "shared"), strict=True):
                await registering(store, name)()
                view.reset_hooks.append(registering(store, name))
            for view in views:
                await view.refresh()
            seen_by_x = views[0].snapshot.version
            server.stop()
            shutil.rmtree(tmp_path / "appendonlydir")
            server.start()
            for _ in range(2):  # y notices (a reconnect may cost the first call)
                await views[1].refresh()
            for tenant in range(seen_by_x + 2):
                assert await stores[1].swap_tenant(f"t{tenant}", None, Tenant(f"t{tenant}"))
            assert await stores[1].version() > seen_by_x
            for _ in range(2):
                await views[0].refresh()
            return sorted(views[0].snapshot.adapters)
        finally:
            for store in stores:
                await store.close()

    try:
        adapters = asyncio.run(scenario())
    finally:
        server.stop()
    assert adapters == ["shared", "solo"]
