"""Who is calling: API key -> tenant, from a local view of the state store.

StateView keeps the store's Snapshot in memory and reloads it when the store's version moves
(polled every ``refresh_s``, and checked by every generation or tokenizer request: fresh()),
so authenticating a request reads no store and a change made through another replica (a
deleted adapter, a changed owner) holds for every request that starts after the change.
Revocation takes effect at once too: the rate limiter's admit() re-checks the key in the
store on every request (gateway/ratelimit.py). If the store is down the view keeps serving
its last snapshot.

Open mode: while the store holds no tenant and no admin key is configured, requests need no
key and run as the operator (every adapter visible, no limits, no tenant salt); the admin
key always calls as the operator. `loragate serve` allows the open mode only on a loopback
address unless --allow-unauthenticated is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request

from engine.http.errors import ApiError
from gateway.store import Snapshot, StateStore, StoreStamp, StoreUnavailable
from gateway.tenancy import AdapterRecord, Tenant, hash_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Principal:
    """The caller of one request: a tenant with the key it used, or the open mode (None)."""

    tenant: Tenant | None
    key_hash: str | None = None

    @property
    def tenant_id(self) -> str | None:
        return self.tenant.tenant_id if self.tenant else None


class StateView:
    """The gateway's local copy of the store (see the module docstring)."""

    def __init__(self, store: StateStore, refresh_s: float = 0.5) -> None:
        self.store = store
        self.refresh_s = refresh_s
        self.snapshot = Snapshot(version=-1)
        self.store_available = True
        self._tenants_seen = False
        self._reload_lock = asyncio.Lock()
        self._lock = asyncio.Lock()
        self._asked = 0
        """fresh() calls so far; each call's number is its ticket."""
        self._answered = 0
        """Every ticket up to this one was answered by a version check that began after it."""
        self.listeners: list[Callable[[Snapshot], None]] = []
        """Called with every newly loaded snapshot."""
        self._stamp: StoreStamp | None = None
        """The store's stamp at the last refresh that reached it."""
        self.reset_hooks: list[Callable[[], Awaitable[None]]] = []
        """Awaited when the store lost its data or went back to older data (a Redis
        restarted empty, or restored from a dump: a new incarnation, or a version lower
        than seen), before the snapshot is reloaded: what this gateway wrote at
        startup (the adapters given on its command line) may be gone and is written again."""

    async def refresh(self) -> None:
        """Reload the snapshot if the store's version moved; never raises on an outage.
        One at a time: two reloads finishing out of order would put back the older one."""
        async with self._reload_lock:
            await self._reload()

    async def _reload(self) -> None:
        try:
            stamp = await self.store.stamp()
            known = self._stamp
            if known is not None and (stamp.incarnation != known.incarnation
                                      or stamp.version < known.version):
                log.warning("the state store lost or rolled back its data (restarted empty, "
                            "or restored: version %d, %d before): writing this gateway's "
                            "startup records again", stamp.version, known.version)
                for hook in self.reset_hooks:
                    await hook()
                stamp = await self.store.stamp()
            self._stamp = stamp
            if stamp.version != self.snapshot.version or stamp != known:
                self.snapshot = await self.store.snapshot()
                for listener in self.listeners:
                    listener(self.snapshot)
            if not self.store_available:
                log.warning("state store reachable again")
            self.store_available = True
        except StoreUnavailable as exc:
            if self.store_available:
                log.error("state store unavailable, serving the last snapshot: %s", exc)
            self.store_available = False

    async def fresh(self) -> None:
        """Make the view at least as new as the store was when this call began: one version
        read (the snapshot reloaded only when it moved). Concurrent callers share reads: one
        read at a time answers every caller that arrived before it began, so a burst (of
        requests, or of unknown keys) costs the store two reads, not one per request. While
        the store is down this returns at once (the poll in run() notices its return)."""
        self._asked += 1
        ticket = self._asked
        async with self._lock:
            if self._answered >= ticket or not self.store_available:
                return
            covered = self._asked
            await self.refresh()
            self._answered = covered

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            with contextlib.suppress(Exception):
                await self.refresh()

    @property
    def open_mode(self) -> bool:
        """No tenant was ever seen. Sticky: once tenants existed, an empty store (every
        tenant deleted, or a Redis that lost its data) never reopens the gateway."""
        if self.snapshot.tenants:
            self._tenants_seen = True
        return not self._tenants_seen

    def current(self, principal: Principal) -> Principal:
        """The caller with its tenant's record as the view holds it now (a change to its
        limits, tier or shared salt made through another replica a moment ago holds from
        the request that follows it); 401 when its key or tenant is gone from the view."""
        if principal.tenant is None or principal.key_hash is None:
            return principal  # the operator, or the open mode: no record to follow
        record = self.snapshot.keys.get(principal.key_hash)
        tenant = self.snapshot.tenants.get(principal.tenant.tenant_id)
        if tenant is None or record is None or not record.held_by(tenant):
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        return Principal(tenant, principal.key_hash)

    def adapters_for(self, principal: Principal) -> dict[str, AdapterRecord]:
        tenant_id = principal.tenant_id
        uid = principal.tenant.uid if principal.tenant else ""
        return {name: a for name, a in self.snapshot.adapters.items()
                if a.visible_to(tenant_id, uid)}


def bearer(request: Request) -> str | None:
    """The key of the request's ``Authorization: Bearer`` header (None: none given). Two
    Authorization headers are a 400: which one counts would be up to each proxy on the way
    (the field is a single value, RFC 9110)."""
    headers = request.headers.getlist("authorization")
    if len(headers) > 1:
        raise ApiError(400, "send one Authorization header, not several",
                       code="invalid_authorization")
    header = headers[0] if headers else ""
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def authenticate(request: Request, view: StateView, admin_key: str | None = None
                 ) -> Principal:
    """The caller, or 401 in OpenAI's schema. The admin key calls as the operator."""
    key = bearer(request)
    if (view.open_mode and not admin_key) or (
            admin_key and key and hmac.compare_digest(key.encode(), admin_key.encode())):
        return Principal(None)
    if key is None:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    key_hash = hash_key(key)
    record = view.snapshot.keys.get(key_hash)
    tenant = view.snapshot.tenants.get(record.tenant_id) if record else None
    if tenant is None or record is None or not record.held_by(tenant):
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    return Principal(tenant, key_hash)


def require_admin(request: Request, admin_key: str | None) -> None:
    """The admin API needs the operator's key (401 without it, 403 when none is set)."""
    if not admin_key:
        raise ApiError(403, "the admin API is disabled: start the gateway with --admin-key "
                       "(or LORAGATE_ADMIN_KEY)", code="admin_disabled")
    key = bearer(request)
    if key is None or not hmac.compare_digest(key.encode(), admin_key.encode()):
        raise ApiError(401, "admin key required", code="invalid_api_key")
