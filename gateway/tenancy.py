"""Tenants, API keys and adapter records: the plain data the state store keeps.

Keys are random tokens shown once at creation; only their SHA-256 is stored, so a leaked
store does not leak working keys. A tenant sees the adapters it owns, the adapters shared
with it, and public adapters (registered by the operator without an owner).

A tenant's identity is its id plus a random ``uid`` given at creation: ownership and the
prefix-cache salt use both, so a tenant deleted and created again under the same id starts
with nothing of the old one (no adapters, no cached prefixes).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass, field

from engine.invalid_field import InvalidField

KEY_PREFIX = "lg-"
SHARED_SALT_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
_UID_PATTERN = re.compile(r"[0-9a-f]{1,64}")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh API key (shown once; store hash_key(key))."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


LIMIT_BOUNDS = {"rpm": 10**9, "tpm": 10**12, "max_concurrency": 10**6}
"""The largest limit of each kind: far above any real tenant's, and exact where the
counters are kept (the Redis scripts' numbers are doubles, exact to 2**53)."""


def new_uid() -> str:
    """A fresh tenant uid: 64 random bits, hex."""
    return secrets.token_hex(8)


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
    tenant's requests only ever hit blocks its own requests cached. 1-128 letters, digits,
    '.', '_' or '-'."""
    uid: str = field(default_factory=new_uid)
    """Random id of this incarnation of the tenant (lowercase hex), given at creation and
    kept by updates; "" for a record written before uids existed (it keeps the salt it
    had)."""

    def __post_init__(self) -> None:
        if not self.tenant_id or not all(c.isalnum() or c in "-_." for c in self.tenant_id):
            raise InvalidField("tenant_id", f"tenant_id must be non-empty letters, digits, "
                               f"'-', '_' or '.', got {self.tenant_id!r}")
        if not isinstance(self.name, str):
            raise InvalidField("name", f"name must be a string, got {self.name!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidField("priority", f"priority must be an integer, got "
                               f"{self.priority!r}")
        if self.shared_salt is not None and not (
                isinstance(self.shared_salt, str)
                and SHARED_SALT_PATTERN.fullmatch(self.shared_salt)):
            raise InvalidField("shared_salt", f"shared_salt must be null or 1-128 letters, "
                               f"digits, '.', '_' or '-', got {self.shared_salt!r}")
        if not isinstance(self.uid, str) or (self.uid and not _UID_PATTERN.fullmatch(self.uid)):
            raise InvalidField("uid", f"uid must be lowercase hex, got {self.uid!r}")
        for name, most in LIMIT_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 1 <= value <= most):
                raise InvalidField(name, f"{name} must be null or an integer from 1 to "
                                   f"{most}, got {str(value)[:32]}")
        if not -100 <= self.priority <= 100:
            raise InvalidField("priority", f"priority must be in [-100, 100], got "
                               f"{self.priority}")

    @property
    def cache_salt(self) -> str:
        """Salt mixed into every block hash of this tenant's requests. Never starts with a
        digit (derive_cache_salt relies on it); ids and salts hold no ':'."""
        if self.shared_salt:
            return f"shared:{self.shared_salt}"
        return f"tenant:{self.tenant_id}:{self.uid}" if self.uid else f"tenant:{self.tenant_id}"


OPERATOR_SALT_PREFIX = "operator:"
"""Tenant salts start with "tenant:" or "shared:", derived ones with a digit."""


def derive_cache_salt(tenant_salt: str | None, requested: str | None) -> str | None:
    """The salt of a request: the tenant's salt, then the request's own cache_salt if any.

    Injective: the tenant's salt is length-prefixed, so no two distinct (tenant salt,
    requested) pairs give one string, whatever characters either holds; a tenant salt alone
    starts with a letter, a derived one with a digit. tenant_salt None (the operator, the
    open mode): the requested salt under "operator:", a prefix no tenant salt has, so not
    even the admin key reaches (or times) a tenant's blocks by sending its salt."""
    if tenant_salt is None:
        return f"{OPERATOR_SALT_PREFIX}{requested}" if requested else None
    if not requested:
        return tenant_salt
    return f"{len(tenant_salt)}:{tenant_salt}/{requested}"


@dataclass(frozen=True)
class ApiKey:
    """A stored key: its hash, owner and a short id to list and revoke it by."""

    key_hash: str
    tenant_id: str
    key_id: str
    created: float
    tenant_uid: str = ""
    """The owner's Tenant.uid when the key was issued: a key issued while its tenant was
    being deleted (by another request or replica) is not held by a later tenant with the
    same id. "": a key issued before uids were recorded, held by the tenant of its id."""

    def held_by(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` (the one now stored under its id) holds this key."""
        return self.tenant_id == tenant.tenant_id and self.tenant_uid in ("", tenant.uid)


@dataclass(frozen=True)
class AdapterRecord:
    """An adapter the gateway serves: where its PEFT directory is and who may use it."""

    name: str
    path: str
    owner: str | None = None
    """Owning tenant; None: public (every tenant sees it)."""
    shared_with: tuple[str, ...] = field(default_factory=tuple)
    owner_uid: str = ""
    """The owner's Tenant.uid when it was bound: a later tenant with the owner's id but
    another uid does not own it."""
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

    def visible_to(self, tenant_id: str | None, tenant_uid: str = "") -> bool:
        """tenant_id None: the open single-tenant mode, or the operator: sees everything
        (except an adapter whose delete is pending: nobody may start using it)."""
        if self.deleting:
            return False
        return (tenant_id is None or self.owner is None
                or (self.owner == tenant_id and self.owner_uid == tenant_uid)
                or tenant_id in self.shared_with)
