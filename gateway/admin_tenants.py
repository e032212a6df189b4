"""Admin routes for tenants and their API keys (Bearer <admin key>).

    POST/GET          /admin/tenants                     create (201) / list
    GET/PATCH/DELETE  /admin/tenants/{id}                DELETE also deletes its keys and
                                                         the adapters it owns
    POST/GET          /admin/tenants/{id}/keys           new key (shown once) / list (ids only)
    POST              /admin/tenants/{id}/keys/{key_id}/rotate   new key, old one revoked
    DELETE            /admin/tenants/{id}/keys/{key_id}  revoke

A tenant created again under a deleted tenant's id is a new tenant (a new uid): it sees none
of the old one's adapters and hits none of its cached prefixes.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from engine.http.errors import ApiError
from engine.invalid_field import field_of
from gateway import adapter_admin as lifecycle
from gateway.admin_common import NAME_PATTERN, AdminGateway, get_tenant
from gateway.openai_text import Text
from gateway.service import Gateway
from gateway.tenancy import ApiKey, Tenant, hash_key, new_key

MAX_TENANT_NAME = 256
PATCH_ATTEMPTS = 20
"""A PATCH reads and reapplies its fields this often while other writes to the tenant win
the race, then answers 409."""


class TenantBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: str = Field(pattern=NAME_PATTERN)
    name: Annotated[Text, Field(max_length=MAX_TENANT_NAME)] = ""
    priority: StrictInt = 0
    rpm: StrictInt | None = None
    tpm: StrictInt | None = None
    max_concurrency: StrictInt | None = None
    shared_salt: Text | None = None


class TenantPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[Text, Field(max_length=MAX_TENANT_NAME)] | None = None
    priority: StrictInt | None = None
    rpm: StrictInt | None = None
    tpm: StrictInt | None = None
    max_concurrency: StrictInt | None = None
    shared_salt: Text | None = None


def build_tenant_router(pending: lifecycle.PendingDeletes) -> APIRouter:
    """Tenant and key routes; ``pending``: the pending adapter deletes (shared with the
    adapter routes): a deleted tenant's adapters, and their uploads, go through it."""
    # Prefixed here, not by an enclosing router: FastAPI keeps a nested route's own path as
    # its template, and the response metrics label responses by that template.
    router = APIRouter(prefix="/admin", tags=["admin"])
    uploads = pending.uploads

    @router.post("/tenants", status_code=201)
    async def create_tenant(body: TenantBody, gw: AdminGateway) -> dict[str, Any]:
        tenant = _tenant(**body.model_dump())
        # Compare and set from "no such tenant": of two concurrent creates, one gets 409.
        if not await gw.view.store.swap_tenant(tenant.tenant_id, None, tenant):
            raise ApiError(409, f"tenant {body.tenant_id!r} already exists")
        await gw.view.refresh()
        return asdict(tenant)

    @router.get("/tenants")
    async def list_tenants(gw: AdminGateway) -> list[dict[str, Any]]:
        snapshot = await gw.view.store.snapshot()
        return [asdict(t) for t in snapshot.tenants.values()]

    @router.get("/tenants/{tenant_id}")
    async def show_tenant(tenant_id: str, gw: AdminGateway) -> dict[str, Any]:
        return asdict(await get_tenant(gw, tenant_id))

    @router.patch("/tenants/{tenant_id}")
    async def update_tenant(tenant_id: str, body: TenantPatch,
                            gw: AdminGateway) -> dict[str, Any]:
        changes = body.model_dump(exclude_unset=True)
        # Read, apply, compare and set; read again when another write came between, so two
        # PATCHes of different fields both hold, and one racing a DELETE answers 404 instead
        # of bringing the tenant back.
        for _ in range(PATCH_ATTEMPTS):
            current = await get_tenant(gw, tenant_id)
            tenant = _tenant(**{**asdict(current), **changes})
            if await gw.view.store.swap_tenant(tenant_id, current, tenant):
                await gw.view.refresh()
                return asdict(tenant)
        raise ApiError(409, f"tenant {tenant_id!r} kept changing while this update was "
                       f"applied: try again")

    @router.delete("/tenants/{tenant_id}")
    async def delete_tenant(tenant_id: str, gw: AdminGateway) -> dict[str, Any]:
        tenant = await get_tenant(gw, tenant_id)
        # Its adapters go as a DELETE of each would: hidden at once (pending delete, owned
        # by nobody, so the tenant's own deletion leaves them), and their names stay taken
        # until every engine unloaded them: old weights never answer for a new adapter.
        hidden = await lifecycle.hide_owned(gw.view.store, tenant)
        # Keys go with it; a tenant created later under this id gets a new uid, hence a new
        # cache salt: it inherits nothing. Only the incarnation read above is deleted: one
        # created again meanwhile (after another DELETE) stays.
        dropped = await gw.view.store.delete_tenant(tenant_id, tenant.uid)
        await gw.view.refresh()
        if dropped is None:
            raise ApiError(404, f"tenant {tenant_id!r} was deleted meanwhile")
        unloaded, still_held = {}, []
        for name in hidden:
            tombstone = gw.view.snapshot.adapters.get(name)
            if tombstone is None or not tombstone.deleting:
                continue  # a DELETE of the adapter finished meanwhile
            unloaded[name], held = await lifecycle.unload_everywhere(gw, name)
            if held:  # in use: unloaded (and its upload removed) when its requests end
                still_held.append(name)
                pending.start(gw, name)
            else:
                await lifecycle.drop(gw, tombstone, uploads)
        return {"tenant_id": tenant_id, "status": "deleted",
                "adapters_deleted": sorted(hidden + dropped), "unloaded": unloaded,
                "adapters_pending_delete": still_held}

    # -------------------------------------------------------------------- keys
    @router.post("/tenants/{tenant_id}/keys", status_code=201)
    async def create_key(tenant_id: str, gw: AdminGateway) -> dict[str, Any]:
        return await _issue_key(gw, await get_tenant(gw, tenant_id))

    @router.get("/tenants/{tenant_id}/keys")
    async def list_keys(tenant_id: str, gw: AdminGateway) -> list[dict[str, Any]]:
        tenant = await get_tenant(gw, tenant_id)
        snapshot = await gw.view.store.snapshot()
        return [{"key_id": k.key_id, "created": k.created}
                for k in snapshot.keys.values() if k.held_by(tenant)]

    @router.post("/tenants/{tenant_id}/keys/{key_id}/rotate", status_code=201)
    async def rotate_key(tenant_id: str, key_id: str,
                         gw: AdminGateway) -> dict[str, Any]:
        tenant, old = await _get_key(gw, tenant_id, key_id)
        issued = await _issue_key(gw, tenant)
        await gw.view.store.delete_key(old.key_hash)
        await gw.view.refresh()
        return issued

    @router.delete("/tenants/{tenant_id}/keys/{key_id}")
    async def revoke_key(tenant_id: str, key_id: str,
                         gw: AdminGateway) -> dict[str, str]:
        _, key = await _get_key(gw, tenant_id, key_id)
        await gw.view.store.delete_key(key.key_hash)
        await gw.view.refresh()
        return {"key_id": key_id, "status": "revoked"}

    return router


def _tenant(**fields: Any) -> Tenant:
    try:
        return Tenant(**fields)
    except (ValueError, TypeError) as exc:
        raise ApiError(400, str(exc), param=field_of(exc)) from None


async def _get_key(gw: Gateway, tenant_id: str, key_id: str) -> tuple[Tenant, ApiKey]:
    """The tenant and its key ``key_id`` (404 naming whichever is missing)."""
    tenant = await get_tenant(gw, tenant_id)
    for key in (await gw.view.store.snapshot()).keys.values():
        if key.held_by(tenant) and key.key_id == key_id:
            return tenant, key
    raise ApiError(404, f"key {key_id!r} of tenant {tenant_id!r} does not exist")


async def _issue_key(gw: Gateway, tenant: Tenant) -> dict[str, Any]:
    """A new key bound to this tenant (its uid: should the tenant be deleted meanwhile, the
    key is held by no later tenant of the same id)."""
    key = new_key()
    record = ApiKey(hash_key(key), tenant.tenant_id, uuid.uuid4().hex[:12], time.time(),
                    tenant.uid)
    stored = await gw.view.store.put_key(record)
    await gw.view.refresh()
    if not stored:  # deleted (and perhaps created again) since the route read it
        raise ApiError(404, f"tenant {tenant.tenant_id!r} was deleted meanwhile")
    return {"key": key, "key_id": record.key_id, "tenant_id": tenant.tenant_id,
            "note": "store this key now: it is not shown again"}
