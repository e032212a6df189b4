"""What every admin route shares: the admin-key dependency, name rules, tenant lookups and
running an action on the engine instances."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request

from engine.http.errors import ApiError
from engine.protocol import EngineClient, EngineRejected, EngineUnavailable
from gateway.auth import require_admin
from gateway.service import Gateway
from gateway.tenancy import Tenant

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def _admin(request: Request) -> Gateway:
    """The app's gateway, once the caller proved it holds the admin key."""
    gateway: Gateway = request.app.state.gateway
    require_admin(request, gateway.config.admin_key)
    return gateway


AdminGateway = Annotated[Gateway, Depends(_admin)]


async def get_tenant(gw: Gateway, tenant_id: str) -> Tenant:
    tenant = (await gw.view.store.snapshot()).tenants.get(tenant_id)
    if tenant is None:
        raise ApiError(404, f"tenant {tenant_id!r} does not exist")
    return tenant


async def owner_uid(gw: Gateway, owner: str | None) -> str:
    """The uid that binds an adapter to its owner ("" for none); 400 if no such tenant."""
    if owner is None:
        return ""
    tenant = (await gw.view.store.snapshot()).tenants.get(owner)
    if tenant is None:
        raise ApiError(400, f"owner: tenant {owner!r} does not exist", param="owner")
    return tenant.uid


async def on_instances(gw: Gateway, instance_id: str | None,
                        action: Callable[[EngineClient], Awaitable[Any]]) -> dict[str, str]:
    targets = [i for i in gw.pool.healthy() if instance_id in (None, i.instance_id)]
    if instance_id is not None and not targets:
        raise ApiError(404, f"instance {instance_id!r} is not a healthy instance")
    results: dict[str, str] = {}
    for instance in targets:
        try:
            await action(instance.client)
            results[instance.instance_id] = "ok"
        except EngineRejected as exc:
            results[instance.instance_id] = f"refused: {exc.message}"
        except EngineUnavailable as exc:
            results[instance.instance_id] = f"unavailable: {exc}"
    await gw.pool.poll()
    return results
