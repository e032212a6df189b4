"""Admin API (Bearer <admin key>): adapters here, tenants and keys in
gateway/admin_tenants.py, vLLM's runtime adapter endpoints in gateway/vllm_adapter_api.py
(build_admin_router serves all three).

    POST/GET          /admin/adapters                    register by path / list with status
    POST              /admin/adapters/upload?name=&owner=|public=true   a .tar(.gz)/.zip upload
    GET/PATCH/DELETE  /admin/adapters/{name}             status / owner+sharing / delete
    POST              /admin/adapters/{name}/load|unload|pin   on every (or one) instance

Adapters are validated against the base model and the engines' max_lora_rank before they
are recorded, with their content digest (a refused upload leaves nothing behind). They are
private to ``owner`` unless registered with public=true. Delete waits for the engines:
409 while requests use the adapter, or with ?force=true 202 and a delete that completes
when they end (gateway/adapter_admin.py). Every change is visible to every gateway replica
sharing the store within state_refresh_s, and a revoked key fails at once (the rate
limiter re-checks it).
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool

from engine.http.errors import ApiError
from engine.models.loader import load_hf_config
from engine.models.shape import ModelShape
from engine.protocol import EngineClient, EngineRejected
from gateway import adapter_admin as lifecycle
from gateway.adapter_upload import remove_tree
from gateway.admin_common import (
    NAME_PATTERN,
    AdapterPath,
    AdminGateway,
    check_shared_with,
    on_instances,
    owner_uid,
    public_id,
)
from gateway.admin_tenants import build_tenant_router
from gateway.service import Gateway
from gateway.tenancy import AdapterRecord
from gateway.vllm_adapter_api import build_vllm_adapter_router
from lora.adapter import LoraAdapter, load_adapter

TenantId = Annotated[str, Field(pattern=NAME_PATTERN)]
def _each_once(tenant_ids: list[str]) -> list[str]:
    # A share is a set of tenants: a repeated id is the same share, kept once, in the order sent.
    return list(dict.fromkeys(tenant_ids))


SharedWith = Annotated[list[TenantId], Field(max_length=1024), AfterValidator(_each_once)]


UPLOAD_PARAMS = frozenset({"name", "owner", "public"})
"""The query parameters of POST /admin/adapters/upload."""


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    path: AdapterPath
    owner: TenantId | None = None
    public: StrictBool = False
    """Every tenant may use it; required (instead of owner) for a public adapter."""
    shared_with: SharedWith = Field(default_factory=list)


class AdapterPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    owner: TenantId | None = None
    public: StrictBool = False
    """With owner null: the adapter becomes public, which must be said explicitly (as at
    registration)."""
    shared_with: SharedWith | None = None


class PlacementBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instance: str | None = None
    """One instance: its public id (GET /instances), or its URL; None: every healthy
    instance."""
    pinned: bool = True


def build_admin_router(model_dir: str, pending: lifecycle.PendingDeletes) -> APIRouter:
    """Admin routes; uploads are stored under ``pending.uploads``."""
    shape = ModelShape.from_hf_config(load_hf_config(model_dir))
    uploads = pending.uploads
    uploading: set[str] = set()  # names whose upload is being received or unpacked

    router = APIRouter(prefix="/admin", tags=["admin"])

    # ---------------------------------------------------------------- adapters
    @router.post("/adapters", status_code=201)
    async def register_adapter(body: AdapterBody, gw: AdminGateway) -> JSONResponse:
        lifecycle.check_owner(body.owner, body.public)
        await lifecycle.check_name_free(gw, body.name)
        path = str(Path(body.path).resolve())
        adapter = await validate_adapter(body.name, path, shape, lifecycle.max_rank(gw))
        # A second name for an uploaded directory shares the upload (see adapter_admin).
        known = (await gw.view.store.snapshot()).adapters.values()
        same_upload = [a for a in known if a.path == path and a.upload_id]
        lifecycle.check_upload_alias(same_upload, body.owner, param="path")
        upload_id = same_upload[0].upload_id if same_upload else None
        record = AdapterRecord(body.name, path, body.owner, tuple(body.shared_with),
                               digest=adapter.digest, upload_id=upload_id)
        return await record_adapter(gw, record)

    @router.post("/adapters/upload", status_code=201)
    async def upload_adapter(request: Request, gw: AdminGateway, name: str,
                             owner: str | None = None, public: bool = False) -> JSONResponse:
        repeated = [p for p in sorted(UPLOAD_PARAMS) if len(request.query_params.getlist(p)) > 1]
        if repeated:  # which one would count is a guess a client should not have to make
            raise ApiError(400, f"query parameter {repeated[0]!r} is given more than once",
                           param=repeated[0])
        unknown = sorted(set(request.query_params) - UPLOAD_PARAMS)
        if unknown:  # as a JSON admin body refuses a field it does not know
            raise ApiError(400, f"unknown query parameter {unknown[0][:64]!r}: an upload takes "
                           f"name, owner and public (share it afterwards with PATCH "
                           f"/admin/adapters/{{name}})", param=unknown[0][:64])
        if not _valid_name(name):
            raise ApiError(400, f"adapter name {name!r} must match {NAME_PATTERN}",
                           param="name")
        lifecycle.check_owner(owner, public)
        await lifecycle.check_name_free(gw, name)
        # A directory of its own per upload: names are the store's to decide (two gateways
        # with different stores may share this directory, and a directory a stopped gateway
        # left behind never blocks a name).
        upload_id = uuid.uuid4().hex
        target = uploads / f"{name}.{upload_id[:16]}"
        await owner_uid(gw, owner)  # before unpacking anything
        if name in uploading:
            raise ApiError(409, f"adapter {name!r} already exists", code="adapter_exists",
                           param="name")
        rank = lifecycle.max_rank(gw)
        cap = lifecycle.unpacked_cap(shape, rank)
        uploading.add(name)
        body: Path | None = None
        staging: Path | None = None
        try:
            body = await lifecycle.receive_upload(request, _ensure(uploads), cap)
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=uploads))
            adapter = await asyncio.to_thread(lifecycle.unpack_and_validate, body, staging,
                                              name, shape, rank, cap)
            staging.rename(target)
            staging = None
        except ValueError as exc:
            raise ApiError(400, f"adapter upload refused: {exc}", param="body") from None
        finally:
            uploading.discard(name)
            if body is not None:
                body.unlink(missing_ok=True)
            if staging is not None:
                await asyncio.to_thread(remove_tree, staging)
        record = AdapterRecord(name, str(target), owner, digest=adapter.digest,
                               upload_id=upload_id)
        try:  # of two uploads racing for the name (on any replica), one is recorded
            return await record_adapter(gw, record)
        except BaseException:
            await asyncio.to_thread(remove_tree, target)
            raise

    @router.get("/adapters")
    async def list_adapters(gw: AdminGateway) -> list[dict[str, Any]]:
        await gw.view.fresh()  # usage counts of names registered again start from zero
        snapshot = await gw.view.store.snapshot()
        return [lifecycle.adapter_status(gw, a) for a in snapshot.adapters.values()]

    @router.get("/adapters/{name}")
    async def get_adapter(name: str, gw: AdminGateway) -> dict[str, Any]:
        await gw.view.fresh()
        return lifecycle.adapter_status(gw, await _get_adapter(gw, name))

    @router.patch("/adapters/{name}")
    async def update_adapter(name: str, body: AdapterPatch,
                             gw: AdminGateway) -> dict[str, Any]:
        current = await _get_live_adapter(gw, name)
        changes = body.model_dump(exclude_unset=True)
        said_public = "public" in changes
        public = changes.pop("public", False)
        if public:
            changes.setdefault("owner", None)
        elif said_public and "owner" not in changes and current.owner is None:
            # A public adapter made private needs the tenant it becomes private to: a 200
            # that left every tenant its access would read as done.
            raise ApiError(400, "public=false makes an adapter private to an owner: give "
                           "owner too", param="owner")
        if "owner" in changes:  # public again only if said so, as at registration
            lifecycle.check_owner(changes["owner"], public)
            if changes["owner"] != current.owner:
                # The shares were the old owner's to give: the new owner gives its own.
                changes.setdefault("shared_with", [])
        if "shared_with" in changes:
            changes["shared_with"] = tuple(changes["shared_with"] or ())
            await check_shared_with(gw, changes["shared_with"])
        record = replace(current, **changes)
        if "owner" in changes:
            record = replace(record, owner_uid=await owner_uid(gw, record.owner))
        if not await gw.view.store.swap_adapter(name, current, record):
            raise _changed_meanwhile(name)
        await gw.view.refresh()
        return lifecycle.adapter_status(gw, record)

    @router.delete("/adapters/{name}")
    async def delete_adapter(name: str, gw: AdminGateway,
                             force: bool = False) -> JSONResponse:
        record = await _get_adapter(gw, name)
        was_pending = record.deleting
        if not was_pending:
            await gw.pool.poll()  # running_requests as of now, not of the last poll
            busy = [public_id(gw, i.instance_id) for i in gw.pool.instances.values()
                    if (a := i.adapters.get(name)) is not None and a.running_requests]
            if busy and not force:
                raise ApiError(409, f"adapter {name!r} is in use on {busy}; retry when idle "
                               f"or pass force=true", code="adapter_in_use")
            # Hidden first: no new request can load it again while it is unloaded.
            hidden = replace(record, deleting=True)
            if not await gw.view.store.swap_adapter(name, record, hidden):
                raise _changed_meanwhile(name)
            record = hidden
            await gw.view.refresh()
            if busy:  # forced: its requests hold it; the unloads are the background's
                pending.start(gw, name)
                return JSONResponse({"name": name, "status": "pending_delete",
                                     "held_by": busy, "unloaded": {}}, status_code=202)
        unloaded, held = await lifecycle.unload_everywhere(gw, name)
        if not held:
            await lifecycle.drop(gw, record, uploads)
            return JSONResponse({"name": name, "status": "deleted", "unloaded": unloaded})
        if not force and not was_pending:  # a request took it between the check and now
            # Shown again only if it is still the record hidden above (a tenant deletion
            # meanwhile made it its own pending delete: that one stands).
            if await gw.view.store.swap_adapter(name, record, replace(record, deleting=False)):
                await gw.view.refresh()
            raise ApiError(409, f"adapter {name!r} is in use on {held}; retry when idle or "
                           f"pass force=true", code="adapter_in_use")
        pending.start(gw, name)
        return JSONResponse({"name": name, "status": "pending_delete", "held_by": held,
                             "unloaded": unloaded}, status_code=202)

    @router.post("/adapters/{name}/load")
    async def load(name: str, body: PlacementBody,
                   gw: AdminGateway) -> dict[str, Any]:
        record = await _get_live_adapter(gw, name)
        return {"name": name, "instances": await on_instances(
            gw, body.instance, lambda c: lifecycle.load_checked(c, record))}

    @router.post("/adapters/{name}/unload")
    async def unload(name: str, body: PlacementBody,
                     gw: AdminGateway) -> dict[str, Any]:
        await _get_adapter(gw, name)

        async def unload_on(client: EngineClient) -> str | None:
            try:
                await client.unload_adapter(name)
            except EngineRejected as exc:
                if exc.status != 404:
                    raise
                return "not loaded"  # an unload done twice is done: nothing to refuse
            return None

        return {"name": name, "instances": await on_instances(gw, body.instance, unload_on)}

    @router.post("/adapters/{name}/pin")
    async def pin(name: str, body: PlacementBody,
                  gw: AdminGateway) -> dict[str, Any]:
        record = await _get_live_adapter(gw, name)

        async def pin_on(client: EngineClient) -> None:
            await lifecycle.load_checked(client, record)
            await client.pin_adapter(name, body.pinned)

        return {"name": name, "instances": await on_instances(gw, body.instance, pin_on)}

    async def register_public(name: str, path: str, gw: Gateway) -> JSONResponse:
        return await register_adapter(AdapterBody(name=name, path=path, public=True), gw)

    async def delete_unforced(name: str, gw: Gateway) -> JSONResponse:
        return await delete_adapter(name, gw, force=False)

    outer = APIRouter()
    outer.include_router(router)
    outer.include_router(build_tenant_router(pending))
    outer.include_router(build_vllm_adapter_router(register_public, delete_unforced))
    return outer


# ------------------------------------------------------------------------ helpers
def _changed_meanwhile(name: str) -> ApiError:
    return ApiError(409, f"adapter {name!r} was changed by another admin call meanwhile; "
                    f"read it again and retry", code="conflict")


def _valid_name(name: str) -> bool:
    return re.fullmatch(NAME_PATTERN, name) is not None


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


async def validate_adapter(name: str, path: str, shape: ModelShape, max_rank: int) -> LoraAdapter:
    """Validate a PEFT directory off the event loop as the engines will load it (their
    smallest max_lora_rank included); 400 naming the problem."""
    try:
        return await asyncio.to_thread(load_adapter, name, path, shape.lora_targets(), max_rank)
    except ValueError as exc:
        raise ApiError(400, f"adapter refused: {exc}", param="path") from None


async def _get_adapter(gw: Gateway, name: str) -> AdapterRecord:
    record = (await gw.view.store.snapshot()).adapters.get(name)
    if record is None:
        raise ApiError(404, f"adapter {name!r} does not exist", code="adapter_not_found",
                       param="name")
    return record


async def _get_live_adapter(gw: Gateway, name: str) -> AdapterRecord:
    record = await _get_adapter(gw, name)
    if record.deleting:
        raise ApiError(409, f"adapter {name!r} is being deleted", code="adapter_deleting",
                       param="name")
    return record


async def record_adapter(gw: Gateway, record: AdapterRecord) -> JSONResponse:
    """Record a validated adapter: 409 if its name is taken, 400 if its owner does not exist
    or an engine refuses it. It is loaded on the engines that answer before it is recorded
    (lifecycle.load_where_reachable), and unloaded from them again when it is not."""
    await lifecycle.check_name_free(gw, record.name)
    await check_shared_with(gw, record.shared_with)
    record = replace(record, owner_uid=await owner_uid(gw, record.owner))
    loaded = await lifecycle.load_where_reachable(gw, record)
    try:
        # Only if the name is still free: of two registrations racing for it (on any
        # gateway replica), exactly one records it.
        if not await gw.view.store.swap_adapter(record.name, None, record):
            winner = (await gw.view.store.snapshot()).adapters.get(record.name)
            if winner is not None and record.digest is not None and \
                    winner.digest == record.digest:
                loaded = []  # the same weights: what the engines hold serves the winner
            await lifecycle.check_name_free(gw, record.name)  # the precise 409
            raise ApiError(409, f"adapter {record.name!r} already exists",
                           code="adapter_exists", param="name")
    except Exception:
        await lifecycle.unload_from(loaded, record)
        raise
    await gw.view.refresh()
    return JSONResponse(lifecycle.adapter_status(gw, record), status_code=201)
