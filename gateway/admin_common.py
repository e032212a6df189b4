"""What every admin route shares: the admin-key dependency, name rules, tenant lookups and
running an action on the engine instances.

Admin answers name an instance by its opaque id (gateway/exposure.py: the one
x-loragate-instance and /instances' ``public_id`` carry), never by its URL, and an
unreachable engine's error text (which quotes its URL) goes to the log, not the answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Annotated

from fastapi import Depends, Request
from pydantic import AfterValidator, Field

from engine.http.errors import ApiError
from engine.protocol import EngineClient, EngineRejected, EngineUnavailable
from gateway.auth import require_admin
from gateway.exposure import instance_tag
from gateway.openai_text import Text
from gateway.service import Gateway
from gateway.tenancy import Tenant

log = logging.getLogger(__name__)

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def _no_nul(path: str) -> str:
    if "\x00" in path:
        raise ValueError("a path holds no NUL character")
    return path


AdapterPath = Annotated[Text, Field(min_length=1, max_length=4096), AfterValidator(_no_nul)]
"""An adapter directory's path in an admin body."""


def _admin(request: Request) -> Gateway:
    """The app's gateway, once the caller proved it holds the admin key."""
    gateway: Gateway = request.app.state.gateway
    require_admin(request, gateway.config.admin_key)
    return gateway


AdminGateway = Annotated[Gateway, Depends(_admin)]


async def get_tenant(gw: Gateway, tenant_id: str) -> Tenant:
    tenant = (await gw.view.store.snapshot()).tenants.get(tenant_id)
    if tenant is None:
        raise ApiError(404, f"tenant {tenant_id!r} does not exist", code="tenant_not_found",
                       param="tenant_id")
    return tenant


async def owner_uid(gw: Gateway, owner: str | None) -> str:
    """The uid that binds an adapter to its owner ("" for none); 400 if no such tenant."""
    if owner is None:
        return ""
    tenant = (await gw.view.store.snapshot()).tenants.get(owner)
    if tenant is None:
        raise ApiError(400, f"owner: tenant {owner!r} does not exist", param="owner")
    return tenant.uid


async def check_shared_with(gw: Gateway, tenant_ids: Iterable[str]) -> None:
    """400 naming shared_with unless every tenant exists: a share with a tenant created
    later under that id would hand it the adapter unasked."""
    tenants = (await gw.view.store.snapshot()).tenants
    unknown = sorted(set(tenant_ids) - set(tenants))
    if unknown:
        raise ApiError(400, f"shared_with: no such tenant: {', '.join(map(repr, unknown))}",
                       param="shared_with")


def public_id(gw: Gateway, instance_id: str) -> str:
    """The id an admin answer names an instance by ("instance-<12 hex>"), as every response's
    x-loragate-instance does; GET /instances maps it to the URL for the operator."""
    return instance_tag(instance_id, gw.config.admin_key)


def unavailable(instance_id: str, exc: EngineUnavailable) -> str:
    """An unreachable engine's entry in an admin answer: its code only ("draining"), as the
    message names the engine's URL; the whole message is logged."""
    log.warning("instance %s: %s", instance_id, exc)
    return "unavailable" if exc.code in (None, "unavailable") else f"unavailable: {exc.code}"


async def on_instances(gw: Gateway, instance: str | None,
                       action: Callable[[EngineClient], Awaitable[object]]
                       ) -> dict[str, str]:
    """Run action on every healthy instance, or on the one ``instance`` names (its public id,
    or its URL); each instance's outcome, by public id: the text action returned, else "ok"."""
    targets = [i for i in gw.pool.healthy()
               if instance in (None, i.instance_id, public_id(gw, i.instance_id))]
    if instance is not None and not targets:  # not echoed: it may be a URL
        raise ApiError(404, "no healthy instance has the id given in instance (GET /instances "
                       "lists them: public_id)", param="instance")
    results: dict[str, str] = {}
    for target in targets:
        shown = public_id(gw, target.instance_id)
        try:
            outcome = await action(target.client)
            results[shown] = outcome if isinstance(outcome, str) else "ok"
        except EngineRejected as exc:
            results[shown] = f"refused: {exc.message}"
        except EngineUnavailable as exc:
            results[shown] = unavailable(target.instance_id, exc)
    await gw.pool.poll()
    return results
