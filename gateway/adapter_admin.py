"""The adapter lifecycle behind the admin routes: ownership, upload intake, rank limits,
and deletion that waits for the engines.

Identity: an adapter on an engine is its name plus the content digest of its weights
(lora.adapter). The gateway records the digest when it validates an adapter, and a request
runs only on an engine that reports the same digest (AdapterPlacement.ensure).

Deletion: a name is free again only once no reachable engine holds it, so the old weights
can never answer for a new adapter registered under the same name. DELETE marks the record
``deleting`` (new requests for it get 404 on every replica), then unloads it everywhere:

- every engine unloaded it: the record goes, and so does its upload directory (below);
- an engine still runs requests on it: without force, 409 and the record is as it was;
  with force=true, 202 ``pending_delete``: the record stays hidden and the gateway retries
  the unload every poll interval until the running requests end (a later DELETE retries
  too, and so does every gateway when it starts: PendingDeletes.resume). Running requests
  are never cut short.

An engine that cannot be reached keeps what it had; the digest check stops it from serving
those weights for a later adapter of the same name.

Upload directories: ``uploads/<name>.<id>``, one per upload, marked by the record's
``upload_id``; a registration by path of that directory shares the upload id. A directory
is removed when the last record carrying it is deleted, and only if its parent is exactly
the uploads directory: a directory registered by path (an operator's) is never removed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import Request

from engine.http.errors import ApiError
from engine.models.shape import ModelShape
from engine.protocol import EngineClient, EngineRejected, EngineUnavailable, LoadedAdapter
from gateway.adapter_upload import extract_archive, remove_tree
from gateway.admin_common import public_id, unavailable
from gateway.instances import Instance
from gateway.service import Gateway
from gateway.store import StateStore
from gateway.tenancy import AdapterRecord, Tenant
from lora.adapter import LoraAdapter, load_adapter

log = logging.getLogger(__name__)

SLACK_BYTES = 1 << 20
"""Room for adapter_config.json, a README and archive headers beyond the weights."""
_WRITE_CHUNK = 1 << 20


def check_owner(owner: str | None, public: bool) -> None:
    """An adapter is private to an owner unless public=true says otherwise, explicitly."""
    if public and owner is not None:
        raise ApiError(400, "give owner (private to that tenant) or public=true, not both",
                       param="owner")
    if not public and owner is None:
        raise ApiError(400, "owner is required: the tenant this adapter is private to (pass "
                       "public=true for an adapter every tenant may use)", param="owner")


def check_upload_alias(records: list[AdapterRecord], owner: str | None, param: str) -> None:
    """A second name for an uploaded directory (``records``: the names it has) reaches no
    tenant that the upload's own names do not: the same owner, or public beside a public
    name. Widening who may use an upload is a PATCH of its own record, which says so."""
    private = [r for r in records if r.owner is not None]
    if not private or owner in {r.owner for r in records}:
        return
    first = private[0]
    raise ApiError(400, f"this path is the upload of adapter {first.name!r}, private to tenant "
                   f"{first.owner!r}: register it with owner {first.owner!r}, or widen who "
                   f"may use it with PATCH /admin/adapters/{first.name} (shared_with, owner)",
                   param=param, code="adapter_private")


def max_rank(gw: Gateway) -> int:
    """The smallest max_lora_rank the engines report: what every one of them can load."""
    ranks = [i.max_lora_rank for i in gw.pool.instances.values() if i.max_lora_rank]
    if not ranks:
        raise ApiError(503, "no engine instance has reported its max_lora_rank yet; retry "
                       "later", code="unavailable",
                       headers={"Retry-After": str(gw.config.retry_after_s)})
    return min(ranks)


def unpacked_cap(shape: ModelShape, rank: int) -> int:
    """Bytes an upload may unpack to: twice the largest adapter the engines can load (all
    seven modules at max rank, float32) plus slack for the config and a README."""
    return 2 * shape.lora_targets().max_adapter_bytes(rank) + SLACK_BYTES


async def check_name_free(gw: Gateway, name: str) -> None:
    """409 unless ``name`` can be registered now (cheap: before any upload is read)."""
    record = (await gw.view.store.snapshot()).adapters.get(name)
    if record is not None and record.deleting:
        raise ApiError(409, f"adapter {name!r} is being deleted; its name is free once every "
                       f"engine unloaded it", code="adapter_deleting", param="name")
    if record is not None:
        raise ApiError(409, f"adapter {name!r} already exists", code="adapter_exists",
                       param="name")
    if name == gw.base_model:
        raise ApiError(409, f"{name!r} is the base model's name", code="adapter_exists",
                       param="name")


async def receive_upload(request: Request, directory: Path, max_bytes: int) -> Path:
    """Stream the request body into a new file in directory (the caller removes it); 413
    once it passes max_bytes, 400 when empty. The event loop only moves chunks."""
    fd, name = tempfile.mkstemp(prefix=".body-", dir=directory)
    path = Path(name)
    size = 0
    pending = bytearray()
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise ApiError(413, f"the upload is over {max_bytes} bytes, more than any "
                                   f"adapter the engines can load", code="upload_too_large",
                                   param="body")
                pending += chunk
                if len(pending) >= _WRITE_CHUNK:
                    await asyncio.to_thread(out.write, bytes(pending))
                    pending.clear()
            await asyncio.to_thread(out.write, bytes(pending))
        if size == 0:
            raise ApiError(400, "adapter upload refused: the upload is empty: send the "
                           "adapter as a .tar, .tar.gz or .zip", param="body")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def unpack_and_validate(upload: Path, staging: Path, name: str, shape: ModelShape, rank: int,
                        cap: int) -> LoraAdapter:
    """Worker thread: unpack into staging and validate it like an engine would load it."""
    extract_archive(upload, staging, cap)
    try:
        return load_adapter(name, staging, shape.lora_targets(), rank)
    except ValueError as exc:  # the staging path means nothing to the caller
        raise ValueError(str(exc).replace(str(staging), "the upload")) from None


def owns_directory(record: AdapterRecord, uploads: Path) -> bool:
    """The record's directory was created by an upload, directly inside ``uploads``."""
    return record.upload_id is not None and Path(record.path).parent == uploads


def reachable(instance: Instance) -> bool:
    """Its last poll answered: what it reports holding is current."""
    return instance.last_ok > 0 and instance.consecutive_failures == 0


async def load_where_reachable(gw: Gateway, record: AdapterRecord) -> list[Instance]:
    """Load a new adapter on every engine that answers now, so that one refusing it (a path
    outside its --adapter-root, a rank over its max) is a 400 naming ``path`` here rather
    than a 500 on every later request; 409 while an engine still runs requests on an
    adapter of that name. Refused anywhere: unloaded again wherever it was loaded. Returns
    the instances that loaded it (an engine down now gets it when it comes up; should it
    refuse it then, requests routed there fail)."""
    loaded: list[Instance] = []
    for instance in list(gw.pool.instances.values()):
        if not reachable(instance):
            continue
        try:
            info = await load_checked(instance.client, record)
        except EngineUnavailable:
            continue
        except EngineRejected as exc:
            await unload_from(loaded, record)
            if exc.status == 409:
                raise ApiError(409, f"adapter {record.name!r} cannot be loaded on an engine "
                               f"now: {exc.message}", code=exc.code or "conflict") from None
            raise ApiError(400, f"an engine refused adapter {record.name!r}: {exc.message}",
                           param="path") from None
        instance.note_loaded(record.path, info)
        loaded.append(instance)
    return loaded


async def unload_from(instances: list[Instance], record: AdapterRecord) -> None:
    """Best effort: undo a load that will not be recorded. Only the record's weights are
    unloaded: a registration of that name that won meanwhile may have replaced them (and
    where this takes away what a recorded adapter needs, AdapterPlacement.ensure
    loads it again: requests carry the digest they mean)."""
    for instance in instances:
        try:
            await instance.client.unload_adapter(record.name, record.digest)
            instance.note_unloaded(record.name, record.digest)
        except EngineRejected as exc:
            if exc.status != 404:  # 404: not there now, or other weights: left alone
                log.warning("could not unload adapter %s from %s again: %s", record.name,
                            instance.instance_id, exc)
        except EngineUnavailable as exc:
            log.warning("could not unload adapter %s from %s again: %s", record.name,
                        instance.instance_id, exc)


async def unload_everywhere(gw: Gateway, name: str) -> tuple[dict[str, str], list[str]]:
    """Ask every engine that reports ``name`` to unload it. Returns each engine's answer and
    the reachable engines that still hold it afterwards (in use there), by public id: what
    the admin answers show (gateway/admin_common.py)."""
    results: dict[str, str] = {}
    for instance in list(gw.pool.instances.values()):
        if name not in instance.adapters:
            continue
        shown = public_id(gw, instance.instance_id)
        try:
            await instance.client.unload_adapter(name)
            results[shown] = "ok"
        except EngineRejected as exc:
            results[shown] = "ok" if exc.status == 404 else f"refused: {exc.message}"
        except EngineUnavailable as exc:
            results[shown] = unavailable(instance.instance_id, exc)
    await gw.pool.poll()
    held = [public_id(gw, i.instance_id) for i in gw.pool.instances.values()
            if reachable(i) and name in i.adapters]
    return results, held


async def drop(gw: Gateway, record: AdapterRecord, uploads: Path) -> None:
    """Delete the record, then its upload directory if no other record names it; its usage
    counts go too (an adapter registered later under the name starts from zero)."""
    await gw.view.store.delete_adapter(record.name)
    await gw.view.refresh()
    gw.usage.pop(record.name, None)
    await remove_upload_dir(gw, record, uploads)


async def remove_upload_dir(gw: Gateway, record: AdapterRecord, uploads: Path) -> None:
    """After ``record`` left the store: remove its directory if an upload created it and no
    remaining record names it (directories registered by path are the operator's)."""
    if not owns_directory(record, uploads):
        return
    others = (await gw.view.store.snapshot()).adapters.values()
    if not any(Path(a.path) == Path(record.path) for a in others):
        await asyncio.to_thread(remove_tree, Path(record.path))


async def finish_delete(gw: Gateway, name: str, uploads: Path) -> None:
    """Background: unload a pending-delete adapter once its requests end, then drop it.
    Gives up (leaving it pending, for a later DELETE or start) after the request timeout:
    by then every request the gateways routed to it has ended."""
    deadline = time.monotonic() + gw.config.request_timeout_s + 60
    while time.monotonic() < deadline:
        await asyncio.sleep(gw.config.poll_interval_s)
        try:
            record = (await gw.view.store.snapshot()).adapters.get(name)
            if record is None or not record.deleting:
                return
            _, held = await unload_everywhere(gw, name)
            if not held:
                await drop(gw, record, uploads)
                log.info("adapter %s deleted (every engine unloaded it)", name)
                return
        except Exception:  # the store or an engine hiccuped: try again next round
            log.exception("finishing the delete of adapter %s", name)
    log.warning("adapter %s is still held by an engine; it stays pending delete", name)


HIDE_ATTEMPTS = 5
"""hide_owned re-reads the adapters this often while admin calls change them under it."""


async def hide_owned(store: StateStore, tenant: Tenant) -> list[str]:
    """Turn every adapter ``tenant`` owns into a pending delete owned by nobody (so that
    deleting the tenant leaves it, its name taken until the engines let go); returns their
    names, sorted. A record changed meanwhile (a PATCH, a DELETE) is read again. Adapters
    bound to another incarnation of its id (a tenant created again meanwhile) stay."""
    hidden: list[str] = []
    for _ in range(HIDE_ATTEMPTS):
        owned = [a for a in (await store.snapshot()).adapters.values()
                 if a.owner == tenant.tenant_id and a.owner_uid in ("", tenant.uid)]
        if not owned:
            break
        for record in owned:
            tombstone = replace(record, owner=None, owner_uid="", shared_with=(),
                                deleting=True)
            if await store.swap_adapter(record.name, record, tombstone):
                hidden.append(record.name)
    return sorted(hidden)


class PendingDeletes:
    """This gateway process's background unloads of pending-delete adapters (finish_delete),
    one task per name: a repeated DELETE does not start another."""

    def __init__(self, uploads: Path) -> None:
        self.uploads = uploads
        """Where uploaded adapters live: an upload goes with its last record."""
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, gw: Gateway, name: str) -> None:
        if name in self._tasks and not self._tasks[name].done():
            return
        task = asyncio.get_running_loop().create_task(finish_delete(gw, name, self.uploads))
        self._tasks[name] = task
        task.add_done_callback(lambda _: self._tasks.pop(name, None)
                               if self._tasks.get(name) is task else None)

    def resume(self, gw: Gateway) -> list[str]:
        """At startup: finish every delete the store has pending (this process's before a
        restart, or a replica's that stopped or gave up); returns their names. Replicas
        resuming one name at once both unload it, and both drop it: harmless."""
        names = sorted(name for name, record in gw.view.snapshot.adapters.items()
                       if record.deleting)
        for name in names:
            self.start(gw, name)
        if names:
            log.info("finishing pending adapter deletes: %s", ", ".join(names))
        return names


def adapter_status(gw: Gateway, record: AdapterRecord) -> dict[str, Any]:
    """What GET /admin/adapters/{name} reports (instances by public id)."""
    instances = {}
    for instance in gw.pool.instances.values():
        state = instance.adapters.get(record.name)
        pool = instance.kv_pools.get(record.name)
        instances[public_id(gw, instance.instance_id)] = {
            "registered": state is not None, "resident": bool(state and state.slot is not None),
            "digest": state.digest if state else None,
            "pinned": bool(state and state.pinned),
            "running_requests": state.running_requests if state else 0,
            "kv_used_blocks": pool.used_blocks if pool else 0,
            "kv_cached_blocks": pool.cached_blocks if pool else 0,
            "prefix_hit_rate": pool.hit_rate if pool else 0.0}
    usage = gw.usage.get(record.name, (0, 0))
    return {"name": record.name, "path": record.path, "owner": record.owner,
            "shared_with": list(record.shared_with), "digest": record.digest,
            "uploaded": record.upload_id is not None,
            "status": "deleting" if record.deleting else "ready",
            "requests_served": usage[0], "tokens_served": usage[1], "instances": instances}


async def load_checked(client: EngineClient, record: AdapterRecord) -> LoadedAdapter:
    """Load the record on one engine; refused unless the engine read the registered content
    (the files at its path changed since it was validated)."""
    info = await client.load_adapter(record.name, record.path)
    if record.digest is not None and info.digest != record.digest:
        raise EngineRejected("its files changed on disk since it was registered", None, 409)
    return info
