"""Tenancy records from their stored JSON, shared by the Redis and SQLite stores.

Each builder returns the record and the names of the fields it does not know (written by a
newer version), so a store can warn about them instead of failing; a field of the wrong
shape raises ValueError or TypeError, and the store skips that record.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gateway.tenancy import AdapterRecord, ApiKey, Tenant


def known_fields(cls: type, data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The fields cls knows, and the names of the others (sorted)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}, sorted(set(data) - names)


def tenant_record(data: dict[str, Any]) -> tuple[Tenant, list[str]]:
    known, unknown = known_fields(Tenant, data)
    known.setdefault("uid", "")  # written before uids: keep its old salt and ownership
    return Tenant(**known), unknown


def key_record(data: dict[str, Any]) -> tuple[ApiKey, list[str]]:
    known, unknown = known_fields(ApiKey, data)
    return ApiKey(**known), unknown


def adapter_record(data: dict[str, Any]) -> tuple[AdapterRecord, list[str]]:
    known, unknown = known_fields(AdapterRecord, data)
    shared = known.get("shared_with") or []
    if not isinstance(shared, list) or not all(isinstance(t, str) for t in shared):
        raise ValueError(f"shared_with must be a list of tenant ids, got {shared!r}")
    return AdapterRecord(**{**known, "shared_with": tuple(shared)}), unknown


def record_id(record: Tenant | ApiKey | AdapterRecord) -> str:
    if isinstance(record, Tenant):
        return record.tenant_id
    return record.key_hash if isinstance(record, ApiKey) else record.name
