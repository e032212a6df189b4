"""SqliteStore: the default StateStore of a gateway without Redis, kept in a local file.

Tenants, keys (hashes only), adapter records and the version survive a restart; the
rate-limit counters and the engine registry stay in memory (MemoryStore's), as they are
per-process anyway without Redis. Reads never touch the file: the whole state is loaded
once at construction and served from memory; each write updates memory, then writes the
records it changed in one SQLite transaction (in a worker thread, off the event loop). A
write the file refuses (disk full, read-only) is undone in memory and raises
StoreUnavailable, so memory and file never disagree.

One gateway per file: the file itself is locked (flock, so a symlink or hard link to a held
file is held too) while a store has it open, and a second gateway on the same file is
refused with a clear error. Gateway replicas share state through Redis instead.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import sqlite3
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from gateway.store import MemoryStore, Snapshot, StoreUnavailable
from gateway.store_records import adapter_record, key_record, tenant_record
from gateway.tenancy import AdapterRecord, ApiKey, Tenant

log = logging.getLogger(__name__)
STATE_PATH_ENV = "LORAGATE_STATE_PATH"
"""Overrides the default state file when GatewayConfig.state_path is None ("" or
":memory:": keep state in memory). The CLI reads the same variable for --state-path."""
IN_MEMORY = ("", ":memory:")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    kind TEXT NOT NULL,   -- 'tenants' | 'keys' | 'adapters'
    id TEXT NOT NULL,     -- tenant id, key hash or adapter name
    json TEXT NOT NULL,
    PRIMARY KEY (kind, id)
);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_BUILDERS: dict[str, Any] = {
    "tenants": tenant_record, "keys": key_record, "adapters": adapter_record}


def loragate_home() -> Path:
    """$LORAGATE_HOME, else ~/.cache/loragate (the demo model lives there too)."""
    return Path(os.environ.get("LORAGATE_HOME", Path.home() / ".cache" / "loragate"))


def resolve_state_path(configured: str | None) -> str | None:
    """The state file to use, or None to keep state in memory. configured None means
    $LORAGATE_STATE_PATH if set, else $LORAGATE_HOME/state.db."""
    if configured is None:
        configured = os.environ.get(STATE_PATH_ENV)
    if configured is None:
        return str(loragate_home() / "state.db")
    return None if configured in IN_MEMORY else configured


class SqliteStore(MemoryStore):
    """MemoryStore whose records and version persist in an SQLite file (see the module
    docstring)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # The lock is on the file itself (its inode): a symlink or a hard link to a file
        # another gateway holds, or a path through a linked directory, finds that lock.
        self._lock_file = _lock(path)
        try:
            # One connection, used by one worker thread at a time (self._write_lock).
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.executescript(_SCHEMA)
            self._load()
        except sqlite3.Error as exc:
            self._lock_file.close()
            raise ValueError(f"cannot use the state file {path}: {exc}") from None
        self._write_lock = asyncio.Lock()

    def _load(self) -> None:
        tables: dict[str, dict[str, Any]] = {kind: {} for kind in _BUILDERS}
        for kind, record_id, text in self._db.execute("SELECT kind, id, json FROM records"):
            if kind not in tables:
                continue
            try:
                record, unknown = _BUILDERS[kind](json.loads(text))
            except (ValueError, TypeError) as exc:
                log.warning("state file %s: skipping unreadable %s record %r: %s", self.path,
                            kind, record_id, exc)
                continue
            if unknown:
                log.warning("state file %s: ignoring unknown fields of %s record %r: %s",
                            self.path, kind, record_id, unknown)
            tables[kind][record_id] = record
        self._tenants, self._keys, self._adapters = (
            tables["tenants"], tables["keys"], tables["adapters"])
        row = self._db.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()
        self._version = int(row[0]) if row else 0

    async def _persisted(self, change: Any) -> Any:
        """Run one of MemoryStore's writes (a coroutine), then write what it changed to the
        file; undo it in memory if the file refuses."""
        async with self._write_lock:
            before = await self.snapshot()
            result = await change
            after = await self.snapshot()
            try:
                await asyncio.to_thread(self._write, _diff(before, after), after.version)
            except sqlite3.Error as exc:
                self._version = before.version
                self._tenants, self._keys, self._adapters = (
                    dict(before.tenants), dict(before.keys), dict(before.adapters))
                raise StoreUnavailable(f"state file {self.path}: {exc}") from None
            return result

    def _write(self, changes: list[tuple[str, str, str | None]], version: int) -> None:
        with self._db:  # one transaction (BEGIN ... COMMIT, ROLLBACK on error)
            self._db.execute("BEGIN")
            for kind, record_id, text in changes:
                if text is None:
                    self._db.execute("DELETE FROM records WHERE kind = ? AND id = ?",
                                     (kind, record_id))
                else:
                    self._db.execute("INSERT OR REPLACE INTO records VALUES (?, ?, ?)",
                                     (kind, record_id, text))
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('version', ?)", (version,))

    async def swap_tenant(self, tenant_id: str, expected: Tenant | None,
                          new: Tenant | None) -> bool:
        swapped: bool = await self._persisted(super().swap_tenant(tenant_id, expected, new))
        return swapped

    async def delete_tenant(self, tenant_id: str, uid: str) -> list[str] | None:
        owned: list[str] | None = await self._persisted(super().delete_tenant(tenant_id, uid))
        return owned

    async def put_key(self, key: ApiKey) -> bool:
        stored: bool = await self._persisted(super().put_key(key))
        return stored

    async def delete_key(self, key_hash: str) -> None:
        await self._persisted(super().delete_key(key_hash))

    async def swap_adapter(self, name: str, expected: AdapterRecord | None,
                           new: AdapterRecord | None) -> bool:
        swapped: bool = await self._persisted(super().swap_adapter(name, expected, new))
        return swapped

    async def delete_adapter(self, name: str) -> None:
        await self._persisted(super().delete_adapter(name))

    async def close(self) -> None:
        async with self._write_lock:
            self._db.close()
            self._lock_file.close()


def _diff(before: Snapshot, after: Snapshot) -> list[tuple[str, str, str | None]]:
    """(kind, id, JSON or None for deleted) of every record that changed."""
    changes: list[tuple[str, str, str | None]] = []
    for kind in _BUILDERS:
        old: dict[str, Any] = getattr(before, kind)
        new: dict[str, Any] = getattr(after, kind)
        changes += [(kind, i, None) for i in old.keys() - new.keys()]
        changes += [(kind, i, json.dumps(asdict(r))) for i, r in new.items() if old.get(i) != r]
    return changes


def _lock(path: str) -> IO[bytes]:
    """An exclusive flock on the database file (created empty if missing: SQLite takes an
    empty file as a new database), held while the store is open. SQLite's own locks are
    POSIX record locks, which on Linux never interact with flock."""
    lock_file = open(path, "ab")  # noqa: SIM115 (held open until close())
    try:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock_file.close()
        raise ValueError(f"the state file {path} is in use by another gateway (one gateway per "
                         f"state file: give this one another --state-path, or share state "
                         f"through --redis-url)") from None
    return lock_file
