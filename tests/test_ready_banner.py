"""The ready banner's curl works as printed in each mode the state puts the gateway in: open
(no key), an admin key, and tenants kept from an earlier start without an admin key (a
tenant's key); its model list names the public adapters the state holds."""

from __future__ import annotations

import asyncio

from gateway.auth import StateView
from gateway.config import GatewayConfig
from gateway.ready_banner import ready_banner
from gateway.store import MemoryStore
from gateway.tenancy import AdapterRecord, Tenant


def banner(admin_key: str | None, tenants: bool) -> str:
    async def view() -> StateView:
        store = MemoryStore()
        if tenants:
            assert await store.swap_tenant("acme", None, Tenant("acme"))
        for record in (AdapterRecord("shout", "/a/shout"),
                       AdapterRecord("private", "/a/private", owner="acme"),
                       AdapterRecord("going", "/a/going", deleting=True)):
            assert await store.swap_adapter(record.name, None, record)
        state = StateView(store, 1.0)
        await state.refresh()
        return state

    return ready_banner(GatewayConfig(admin_key=admin_key, port=8123), "/models/smol",
                        asyncio.run(view()))


def test_open_mode_needs_no_key() -> None:
    text = banner(None, tenants=False)
    assert "Authorization" not in text
    assert "models: smol (base), shout\n" in text  # public ones, not those going away
    assert '(set "model" to an adapter name, e.g. "shout", to use it)' in text


def test_an_admin_key_is_read_from_the_environment() -> None:
    text = banner("secret", tenants=True)
    assert '-H "Authorization: Bearer $LORAGATE_ADMIN_KEY"' in text and "secret" not in text


def test_tenants_without_an_admin_key_need_a_tenant_key() -> None:
    text = banner(None, tenants=True)
    assert '-H "Authorization: Bearer $LORAGATE_API_KEY"' in text
    assert "(with LORAGATE_API_KEY set to a tenant's API key" in text
