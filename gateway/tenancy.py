"""Tenants, API keys and adapter records: the plain data the state store keeps.

Keys are random tokens shown once at creation; only their SHA-256 is stored, so a leaked
store does not leak working keys. A tenant sees the adapters it owns, the adapters shared
with it, and public adapters (registered by the operator without an owner).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field

KEY_PREFIX = "lg-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh API key (shown once; store hash_key(key))."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Tenant:
    """One customer of the gateway."""

    tenant_id: str
    name: str = ""
    priority: int = 0
    """Tier: becomes the engine request priority (larger is served first, preempted last)
    and decides who is shed first when instances fill up."""
    rpm: int | None = None
    """Requests per minute (None: unlimited)."""
    tpm: int | None = None
    """Tokens (prompt + completion) per minute (None: unlimited)."""
    max_concurrency: int | None = None
    """Requests in flight at once through one gateway (None: unlimited)."""
    shared_salt: str | None = None
    """Opt-in: tenants with the same shared salt share prefix-cache blocks; without it a
    tenant's requests only ever hit blocks its own requests cached."""

    def __post_init__(self) -> None:
        if not self.tenant_id or not all(c.isalnum() or c in "-_." for c in self.tenant_id):
            raise ValueError(f"tenant_id must be non-empty letters, digits, '-', '_' or '.', "
                             f"got {self.tenant_id!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {self.name!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.shared_salt is not None and not isinstance(self.shared_salt, str):
            raise ValueError(f"shared_salt must be a string or null, got {self.shared_salt!r}")
        for name in ("rpm", "tpm", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or null, got {value!r}")
        if not -100 <= self.priority <= 100:
            raise ValueError(f"priority must be in [-100, 100], got {self.priority}")

    @property
    def cache_salt(self) -> str:
        """Salt mixed into every block hash of this tenant's requests."""
        return f"shared:{self.shared_salt}" if self.shared_salt else f"tenant:{self.tenant_id}"


@dataclass(frozen=True)
class ApiKey:
    """A stored key: its hash, owner and a short id to list and revoke it by."""

    key_hash: str
    tenant_id: str
    key_id: str
    created: float


@dataclass(frozen=True)
class AdapterRecord:
    """An adapter the gateway serves: where its PEFT directory is and who may use it."""

    name: str
    path: str
    owner: str | None = None
    """Owning tenant; None: public (every tenant sees it)."""
    shared_with: tuple[str, ...] = field(default_factory=tuple)
    digest: str | None = None
    """Content digest of the weights as validated at registration (lora.adapter): engines
    must report this digest to serve it. None: registered on the command line, trusted by
    name."""
    upload_id: str | None = None
    """Set when the directory was created by an upload (shared by records naming the same
    upload directory): deleting the last of them removes the directory."""
    deleting: bool = False
    """Delete pending until every engine unloaded it: new requests for it are refused and
    the name cannot be registered again yet."""

    def visible_to(self, tenant_id: str | None) -> bool:
        """tenant_id None: the open single-tenant mode, or the operator: sees everything."""
        return (tenant_id is None or self.owner is None or self.owner == tenant_id
                or tenant_id in self.shared_with)
