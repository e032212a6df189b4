"""State shared by gateway replicas: one protocol, an in-memory and a Redis implementation.

What lives here: tenants, API keys (hashes only), adapter records, per-minute rate-limit
counters and the engine registry. Writes go straight to the store and bump a version
number; gateways serve the hot path (key -> tenant, which adapters a tenant sees) from a
local Snapshot they reload when the version moves (gateway/state_view.py), so a request
costs no store round trip for reads. The one round trip a limited request pays is admit():
one atomic operation that checks the key is still valid (a revoked key stops working on
every replica at once), checks the tenant's RPM and TPM windows and counts the request.

Rate-limit semantics (both stores): fixed one-minute windows (window = unix_time // 60);
admit() refuses when the window's requests >= rpm or its tokens >= tpm, else counts one
request; charge() adds tokens when a request ends; refund() gives back the request of a
call that never reached an engine. Counters expire two windows later.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from gateway.tenancy import AdapterRecord, ApiKey, Tenant

WINDOW_S = 60


class StoreUnavailable(Exception):
    """The store cannot be reached (Redis down); the caller applies its failure policy."""


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
    """admit()'s answer. reason: "rpm", "tpm" or "revoked" when refused."""

    allowed: bool
    window: int
    reason: str | None = None
    retry_after_s: int = 0


def window_of(now: float) -> int:
    return int(now // WINDOW_S)


def retry_after(now: float) -> int:
    """Whole seconds until the current window ends (at least 1)."""
    return max(1, math.ceil(WINDOW_S - now % WINDOW_S))


class StateStore(Protocol):
    """What a gateway needs from shared state (see the module docstring)."""

    async def snapshot(self) -> Snapshot: ...

    async def version(self) -> int: ...

    async def put_tenant(self, tenant: Tenant) -> None: ...

    async def delete_tenant(self, tenant_id: str) -> None:
        """Also deletes the tenant's keys."""

    async def put_key(self, key: ApiKey) -> None: ...

    async def delete_key(self, key_hash: str) -> None: ...

    async def put_adapter(self, adapter: AdapterRecord) -> None: ...

    async def delete_adapter(self, name: str) -> None: ...

    async def admit(self, key_hash: str | None, tenant_id: str, rpm: int | None,
                    tpm: int | None, now: float | None = None) -> Admission: ...

    async def charge(self, tenant_id: str, tokens: int, window: int) -> None: ...

    async def refund(self, tenant_id: str, window: int) -> None: ...

    async def register_engine(self, url: str, ttl_s: float) -> None: ...

    async def engines(self) -> list[str]: ...

    async def close(self) -> None: ...


class MemoryStore:
    """The embedded default for one gateway: the same semantics in process memory."""

    def __init__(self) -> None:
        self._version = 0
        self._tenants: dict[str, Tenant] = {}
        self._keys: dict[str, ApiKey] = {}
        self._adapters: dict[str, AdapterRecord] = {}
        self._counters: dict[tuple[str, int], list[int]] = {}
        self._engines: dict[str, float] = {}

    def _bump(self) -> None:
        self._version += 1

    async def snapshot(self) -> Snapshot:
        return Snapshot(self._version, dict(self._tenants), dict(self._keys),
                        dict(self._adapters))

    async def version(self) -> int:
        return self._version

    async def put_tenant(self, tenant: Tenant) -> None:
        self._tenants[tenant.tenant_id] = tenant
        self._bump()

    async def delete_tenant(self, tenant_id: str) -> None:
        self._tenants.pop(tenant_id, None)
        for key_hash in [h for h, k in self._keys.items() if k.tenant_id == tenant_id]:
            del self._keys[key_hash]
        self._bump()

    async def put_key(self, key: ApiKey) -> None:
        self._keys[key.key_hash] = key
        self._bump()

    async def delete_key(self, key_hash: str) -> None:
        self._keys.pop(key_hash, None)
        self._bump()

    async def put_adapter(self, adapter: AdapterRecord) -> None:
        self._adapters[adapter.name] = adapter
        self._bump()

    async def delete_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)
        self._bump()

    async def admit(self, key_hash: str | None, tenant_id: str, rpm: int | None,
                    tpm: int | None, now: float | None = None) -> Admission:
        now = time.time() if now is None else now
        window = window_of(now)
        if key_hash is not None and key_hash not in self._keys:
            return Admission(False, window, "revoked")
        self._expire(window)
        counts = self._counters.setdefault((tenant_id, window), [0, 0])
        if tpm is not None and counts[1] >= tpm:
            return Admission(False, window, "tpm", retry_after(now))
        if rpm is not None and counts[0] >= rpm:
            return Admission(False, window, "rpm", retry_after(now))
        counts[0] += 1
        return Admission(True, window)

    async def charge(self, tenant_id: str, tokens: int, window: int) -> None:
        self._counters.setdefault((tenant_id, window), [0, 0])[1] += tokens

    async def refund(self, tenant_id: str, window: int) -> None:
        counts = self._counters.get((tenant_id, window))
        if counts is not None and counts[0] > 0:
            counts[0] -= 1

    def _expire(self, window: int) -> None:
        for key in [k for k in self._counters if k[1] < window - 1]:
            del self._counters[key]

    async def register_engine(self, url: str, ttl_s: float) -> None:
        self._engines[url] = time.monotonic() + ttl_s

    async def engines(self) -> list[str]:
        now = time.monotonic()
        return sorted(url for url, expiry in self._engines.items() if expiry > now)

    async def close(self) -> None:
        return None
