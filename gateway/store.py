"""State shared by gateway replicas: one protocol, an in-memory and a Redis implementation.

What lives here: tenants, API keys (hashes only), adapter records, sliding-window rate-limit
counters and the engine registry. Writes go straight to the store and bump a version
number; gateways serve the hot path (key -> tenant, which adapters a tenant sees) from a
local Snapshot they reload when the version moves (gateway/auth.py StateView), so a request
costs no store round trip for reads. A limited request pays two atomic round trips: admit()
(the key is still valid, so a revoked key stops working on every replica at once; the
tenant's RPM and TPM windows are not full; count the request) and reserve() (its prompt +
max_tokens fit the TPM window; take them).

Rate-limit semantics (both stores): per-second buckets over a sliding minute
(gateway/sliding_window.py), passed ``now`` (unix seconds) by the caller.
- admit() refuses when the window's requests >= rpm or its tokens >= tpm, else counts one
  request in the bucket of ``now``;
- reserve() refuses when the window's tokens + tokens > tpm, else adds them to the bucket of
  ``now``;
- charge() adds tokens (negative: gives back, never below zero) to a given bucket while it
  is in the window; refund() gives back the request of a call that never reached an engine.
Refusals carry Retry-After: seconds until enough of the oldest buckets leave the window.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from gateway import sliding_window as sw
from gateway.tenancy import AdapterRecord, ApiKey, Tenant

R = TypeVar("R", Tenant, AdapterRecord)


class StoreUnavailable(Exception):
    """The store cannot be reached (Redis down); the caller applies its failure policy. Its
    message names the store without credentials (gateway/redact.py)."""


@dataclass(frozen=True)
class Snapshot:
    """Everything the hot path reads, as of one version."""

    version: int
    tenants: dict[str, Tenant] = field(default_factory=dict)
    keys: dict[str, ApiKey] = field(default_factory=dict)
    """By key hash."""
    adapters: dict[str, AdapterRecord] = field(default_factory=dict)


@dataclass(frozen=True)
class Admission:
    """admit()'s or reserve()'s answer. reason: "rpm", "tpm" or "revoked" when refused;
    second: the bucket the request or tokens were counted in (for refund() / charge())."""

    allowed: bool
    second: int
    reason: str | None = None
    retry_after_s: int = 0
    requests_used: int | None = None
    """Allowed by admit(): the requests in the tenant's window, this one counted."""
    tokens_used: int | None = None
    """Allowed: the tokens held in the tenant's window (admit(): before this request's
    reservation; reserve(): with it)."""


@dataclass(frozen=True)
class StoreStamp:
    """Which data the store holds: ``incarnation`` stays the same from the store's first use
    until it loses its data (a Redis restarted empty gets a new one); ``version`` counts the
    writes since."""

    incarnation: str
    version: int


class StateStore(Protocol):
    """What a gateway needs from shared state (see the module docstring)."""

    async def snapshot(self) -> Snapshot: ...

    async def version(self) -> int: ...

    async def stamp(self) -> StoreStamp: ...

    async def swap_tenant(self, tenant_id: str, expected: Tenant | None,
                          new: Tenant | None) -> bool:
        """Compare and set, as swap_adapter: what makes one of two concurrent creates of an
        id win, a PATCH that read a record fail instead of undoing a change made since (the
        caller reads again and reapplies its fields), and a PATCH racing a DELETE never bring
        the tenant back. Deleting a tenant goes through delete_tenant (its keys and adapters
        go with it)."""

    async def delete_tenant(self, tenant_id: str, uid: str) -> list[str] | None:
        """Deletes the tenant stored under ``tenant_id`` if it is still the incarnation
        ``uid`` (the one the caller read), else changes nothing and returns None: a DELETE
        never takes a tenant created again under that id meanwhile. Also deletes every key
        of the id and the adapters it owns (their names are returned, sorted), and takes it
        off other adapters' shared_with: a tenant created later under the same id inherits
        nothing. One atomic change."""

    async def put_key(self, key: ApiKey) -> bool:
        """Stores ``key`` if the tenant stored under its tenant_id still holds it (the
        incarnation it was issued to: ApiKey.held_by) and returns True; otherwise writes
        nothing and returns False. One atomic check and write: a key issued while its tenant
        is deleted (by another request or replica) is never stored as an orphan."""

    async def delete_key(self, key_hash: str) -> None: ...

    async def swap_adapter(self, name: str, expected: AdapterRecord | None,
                           new: AdapterRecord | None) -> bool:
        """Compare and set, atomically across gateways: if the record under ``name`` equals
        ``expected`` (None: there is none), replace it with ``new`` (None: delete it) and
        return True; otherwise change nothing and return False. What makes a name taken by
        exactly one of two concurrent registrations, and a PATCH or DELETE that read a record
        fail instead of overwriting a change made since."""

    async def delete_adapter(self, name: str) -> None: ...

    async def admit(self, key_hash: str | None, tenant_id: str, rpm: int | None,
                    tpm: int | None, now: float | None = None) -> Admission: ...

    async def reserve(self, tenant_id: str, tokens: int, tpm: int,
                      now: float | None = None) -> Admission: ...

    async def charge(self, tenant_id: str, tokens: int, second: int,
                     now: float | None = None) -> None: ...

    async def refund(self, tenant_id: str, second: int, now: float | None = None) -> None: ...

    async def register_engine(self, url: str, ttl_s: float) -> None: ...

    async def engines(self) -> list[str]: ...

    async def close(self) -> None: ...


class MemoryStore:
    """The embedded default for one gateway: the same semantics in process memory."""

    def __init__(self) -> None:
        self._version = 0
        self._incarnation = uuid.uuid4().hex
        self._tenants: dict[str, Tenant] = {}
        self._keys: dict[str, ApiKey] = {}
        self._adapters: dict[str, AdapterRecord] = {}
        self._rates: dict[tuple[str, str], dict[int, int]] = {}
        """(tenant, "req" | "tok") -> second -> amount."""
        self._engines: dict[str, float] = {}

    def _bump(self) -> None:
        self._version += 1

    async def snapshot(self) -> Snapshot:
        return Snapshot(self._version, dict(self._tenants), dict(self._keys),
                        dict(self._adapters))

    async def version(self) -> int:
        return self._version

    async def stamp(self) -> StoreStamp:
        return StoreStamp(self._incarnation, self._version)

    async def swap_tenant(self, tenant_id: str, expected: Tenant | None,
                          new: Tenant | None) -> bool:
        return self._swap(self._tenants, tenant_id, expected, new)

    async def delete_tenant(self, tenant_id: str, uid: str) -> list[str] | None:
        current = self._tenants.get(tenant_id)
        if current is None or current.uid != uid:
            return None
        del self._tenants[tenant_id]
        for key_hash in [h for h, k in self._keys.items() if k.tenant_id == tenant_id]:
            del self._keys[key_hash]
        owned = sorted(n for n, a in self._adapters.items() if a.owner == tenant_id)
        for name in owned:
            del self._adapters[name]
        for name, adapter in self._adapters.items():
            if tenant_id in adapter.shared_with:
                self._adapters[name] = replace(adapter, shared_with=tuple(
                    t for t in adapter.shared_with if t != tenant_id))
        self._bump()
        return owned

    async def put_key(self, key: ApiKey) -> bool:
        # Not awaited between the check and the write: atomic on the loop.
        owner = self._tenants.get(key.tenant_id)
        if owner is None or not key.held_by(owner):
            return False
        self._keys[key.key_hash] = key
        self._bump()
        return True

    async def delete_key(self, key_hash: str) -> None:
        self._keys.pop(key_hash, None)
        self._bump()

    async def swap_adapter(self, name: str, expected: AdapterRecord | None,
                           new: AdapterRecord | None) -> bool:
        return self._swap(self._adapters, name, expected, new)

    def _swap(self, table: dict[str, R], name: str, expected: R | None, new: R | None
              ) -> bool:
        # Not a coroutine: no await between the read and the write, so atomic on the loop.
        if table.get(name) != expected:
            return False
        if new is None:
            table.pop(name, None)
        else:
            table[name] = new
        self._bump()
        return True

    async def delete_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)
        self._bump()

    def rate_buckets(self, tenant_id: str) -> dict[str, dict[int, int]]:
        """The tenant's live counters by kind (a copy, for tests and debugging)."""
        return {kind: dict(self._rates.get((tenant_id, kind), {})) for kind in ("req", "tok")}

    def _buckets(self, tenant_id: str, kind: str) -> dict[int, int]:
        return self._rates.setdefault((tenant_id, kind), {})

    async def admit(self, key_hash: str | None, tenant_id: str, rpm: int | None,
                    tpm: int | None, now: float | None = None) -> Admission:
        now = time.time() if now is None else now
        second = sw.second_of(now)
        if key_hash is not None and key_hash not in self._keys:
            return Admission(False, second, "revoked")
        tokens = self._buckets(tenant_id, "tok")
        used = sw.prune(tokens, now)
        if tpm is not None and used >= tpm:
            return Admission(False, second, "tpm", sw.wait_s(tokens, used, 1, tpm, now))
        requests = self._buckets(tenant_id, "req")
        made = sw.prune(requests, now)
        if rpm is not None and made >= rpm:
            return Admission(False, second, "rpm", sw.wait_s(requests, made, 1, rpm, now))
        requests[second] = requests.get(second, 0) + 1
        return Admission(True, second, requests_used=made + 1, tokens_used=used)

    async def reserve(self, tenant_id: str, tokens: int, tpm: int,
                      now: float | None = None) -> Admission:
        now = time.time() if now is None else now
        second = sw.second_of(now)
        buckets = self._buckets(tenant_id, "tok")
        used = sw.prune(buckets, now)
        if used + tokens > tpm:
            return Admission(False, second, "tpm", sw.wait_s(buckets, used, tokens, tpm, now))
        buckets[second] = buckets.get(second, 0) + tokens
        return Admission(True, second, tokens_used=used + tokens)

    async def charge(self, tenant_id: str, tokens: int, second: int,
                     now: float | None = None) -> None:
        self._add(tenant_id, "tok", second, tokens, now)

    async def refund(self, tenant_id: str, second: int, now: float | None = None) -> None:
        self._add(tenant_id, "req", second, -1, now)

    def _add(self, tenant_id: str, kind: str, second: int, amount: int,
             now: float | None) -> None:
        now = time.time() if now is None else now
        buckets = self._buckets(tenant_id, kind)
        sw.prune(buckets, now)
        if second < sw.oldest_live(now):
            return  # that second left the window: nothing to give back or count
        value = buckets.get(second, 0) + amount
        if value > 0:
            buckets[second] = value
        else:
            buckets.pop(second, None)

    async def register_engine(self, url: str, ttl_s: float) -> None:
        self._engines[url] = time.monotonic() + ttl_s

    async def engines(self) -> list[str]:
        now = time.monotonic()
        return sorted(url for url, expiry in self._engines.items() if expiry > now)

    async def close(self) -> None:
        return None
