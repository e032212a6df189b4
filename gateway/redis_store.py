"""RedisStore: the StateStore of several gateway replicas (redis-py asyncio).

Layout (prefix ``lg:`` by default):
    lg:version                 INCR on every write; replicas reload their view when it moves
    lg:tenants / lg:keys / lg:adapters   hashes of JSON records (keys by SHA-256 of the key)
    lg:rl:{tenant}:req         hash unix second -> requests admitted in that second
    lg:rl:{tenant}:tok         hash unix second -> tokens reserved (net of refunds) in it
                               ({tenant}: the id and uid of one incarnation, ratelimit.counted_as)
    lg:engines                 sorted set url -> expiry (unix seconds): engine heartbeats

The rate hashes are the sliding window of gateway/sliding_window.py: every script prunes the
seconds that left the window, and a hash expires SPAN_S + 1 s after its last write. admit(),
reserve() and charge()/refund() are each one Lua script, so two gateways can never both take
the last request or the last tokens of a window. The scripts touch keys of different hash
slots: they need a standalone Redis (or one shard), not Redis Cluster. ``now`` comes from
the gateway's clock: replicas' clocks should agree within a second (NTP).

Every connection or timeout error becomes StoreUnavailable, fast: short socket timeouts and
no retries (but one on a broken connection, which a server restart leaves in the pool),
because the gateway's failure policy (gateway/ratelimit.py) has a better answer than
waiting. Its message, like everything this module logs, names the server
without credentials. A record that does not parse (hand-edited, or written by a newer
version) is skipped by snapshot() with one warning instead of failing every replica;
unknown fields of an otherwise valid record are ignored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, WatchError

from engine.http.registry import REGISTRY_KEY, register
from gateway import redis_scripts
from gateway import sliding_window as sw
from gateway.redact import redact_text, redact_url
from gateway.store import Admission, Snapshot, StoreStamp, StoreUnavailable
from gateway.store_records import adapter_record, key_record, record_id, tenant_record
from gateway.tenancy import AdapterRecord, ApiKey, Tenant

log = logging.getLogger(__name__)
R = TypeVar("R", Tenant, ApiKey, AdapterRecord)
T = TypeVar("T")
Builder = Callable[[dict[str, Any]], tuple[R, list[str]]]
"""A record from its JSON fields, and the names of the fields it does not know."""
WATCH_ATTEMPTS = 20
"""delete_tenant and the swaps retry their optimistic transactions this often while other
writes race them."""

_REFUSED = {-1: "rpm", -2: "tpm", -3: "revoked"}


def check_reachable(url: str, timeout_s: float = 3.0) -> None:
    """ValueError, one line naming the server (never its credentials), when Redis at ``url``
    does not answer a PING (down, wrong port, refused password): `serve` asks before any
    model loads. The failure policy (--store-failure-policy) is for outages once running."""
    import redis
    from redis.exceptions import (
        AuthenticationError,
        AuthenticationWrongNumberOfArgsError,
        AuthorizationError,
    )

    shown = redact_url(url)
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s)
    except ValueError:
        raise ValueError(f"invalid Redis URL {shown}: check its scheme, host, port and "
                         f"database") from None
    try:
        client.ping()
    except (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError
            ) as exc:  # it answered: the credentials (or the user's rights) are wrong
        raise ValueError(f"the state store at {shown} refused the connection: "
                         f"authentication failed ({exc})") from None
    except redis.RedisError as exc:
        raise ValueError(f"the state store at {shown} is unreachable: {exc}") from None
    finally:
        client.close()


class RedisStore:
    """StateStore over one Redis server (see the module docstring)."""

    def __init__(self, url: str, prefix: str = "lg:", timeout_s: float = 0.5) -> None:
        self.url = redact_url(url)
        """The server's URL without credentials (for messages)."""
        self.prefix = prefix
        try:
            self._redis = aioredis.from_url(
                url, decode_responses=True, socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                # One retry, on a broken connection only: after a Redis restart every pooled
                # connection is dead, and each would otherwise fail one request; a timeout
                # is never retried (the failure policy answers faster than waiting again).
                retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        except ValueError:
            # redis-py's message may quote pieces of the URL, credentials included.
            raise ValueError(f"invalid Redis URL {self.url}: check its scheme, host, port "
                             f"and database") from None
        self._admit = self._redis.register_script(redis_scripts.ADMIT)
        self._reserve = self._redis.register_script(redis_scripts.RESERVE)
        self._add = self._redis.register_script(redis_scripts.ADD)
        self._warned: set[tuple[str, str, str]] = set()

    def _k(self, name: str) -> str:
        return self.prefix + name

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except WatchError:
            raise
        except (RedisError, OSError) as exc:
            # No chained cause: tracebacks must not carry the client's own error text.
            raise StoreUnavailable(f"redis at {self.url}: {type(exc).__name__}: "
                                   f"{redact_text(str(exc))}") from None

    # ---------------------------------------------------------------- records
    async def snapshot(self) -> Snapshot:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(self._k("version"))
            pipe.hgetall(self._k("tenants"))
            pipe.hgetall(self._k("keys"))
            pipe.hgetall(self._k("adapters"))
            version, tenants, keys, adapters = await self._call(pipe.execute())
        return Snapshot(version=int(version or 0),
                        tenants=self._records("tenants", tenants, tenant_record),
                        keys=self._records("keys", keys, key_record),
                        adapters=self._records("adapters", adapters, adapter_record))

    def _records(self, table: str, raw: dict[str, str], build: Builder[R]) -> dict[str, R]:
        records = {}
        for name, value in raw.items():
            record = self._parse(table, name, value, build)
            if record is not None:
                records[name] = record
        return records

    def _parse(self, table: str, name: str, value: str, build: Builder[R]) -> R | None:
        """The record stored under ``name``, or None (warned once per record content) when
        it does not parse; unknown fields are dropped with a warning."""
        try:
            data = json.loads(value)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            record, unknown = build(data)
            if record_id(record) != name:
                raise ValueError(f"it is stored under another id ({record_id(record)!r})")
        except (ValueError, TypeError) as exc:
            self._warn_once(table, name, value, f"skipping unreadable {table} record "
                            f"{name!r}: {redact_text(str(exc))}")
            return None
        if unknown:
            self._warn_once(table, name, value, f"ignoring unknown fields of {table} record "
                            f"{name!r}: {unknown} (written by a newer version?)")
        return record

    def _warn_once(self, table: str, name: str, value: str, message: str) -> None:
        seen = (table, name, hashlib.sha256(value.encode()).hexdigest())
        if seen not in self._warned:
            if len(self._warned) > 10_000:  # bounded: records come and go over months
                self._warned.clear()
            self._warned.add(seen)
            log.warning("%s", message)

    async def version(self) -> int:
        return int(await self._call(self._redis.get(self._k("version"))) or 0)

    async def stamp(self) -> StoreStamp:
        """One round trip. The incarnation is made up by whichever gateway asks first after
        Redis started without this data (SET NX), so every gateway reads the same one, and
        one that missed a restart (paused meanwhile) still sees it changed, however far
        the version has climbed since."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._k("incarnation"), uuid.uuid4().hex, nx=True)
            pipe.get(self._k("incarnation"))
            pipe.get(self._k("version"))
            _, incarnation, version = await self._call(pipe.execute())
        return StoreStamp(str(incarnation), int(version or 0))

    async def _delete(self, table: str, field: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._k(table), field)
            pipe.incr(self._k("version"))
            await self._call(pipe.execute())

    async def swap_tenant(self, tenant_id: str, expected: Tenant | None,
                          new: Tenant | None) -> bool:
        return await self._swap("tenants", tenant_id, expected, new, tenant_record)

    async def delete_tenant(self, tenant_id: str, uid: str) -> list[str] | None:
        tenants, keys, adapters = self._k("tenants"), self._k("keys"), self._k("adapters")

        async def change(pipe: Any) -> list[str] | None:
            current = await self._current(pipe, "tenants", tenant_id, tenant_record)
            if current is None or current.uid != uid:
                await self._call(pipe.reset())
                return None
            stored_keys = await self._call(pipe.hgetall(keys))
            stored_adapters = await self._call(pipe.hgetall(adapters))
            owned_keys = [h for h, v in stored_keys.items()
                          if _field(v, "tenant_id") == tenant_id]
            owned, unshared = _tenant_adapters(stored_adapters, tenant_id)
            pipe.multi()
            pipe.hdel(tenants, tenant_id)
            if owned_keys:
                pipe.hdel(keys, *owned_keys)
            if owned:
                pipe.hdel(adapters, *owned)
            for name, value in unshared.items():
                pipe.hset(adapters, name, value)
            pipe.incr(self._k("version"))
            await self._call(pipe.execute())
            return owned

        return await self._watching((tenants, keys, adapters), change,
                                    f"tenant {tenant_id!r} could not be deleted: its keys "
                                    f"and adapters kept changing")

    async def put_key(self, key: ApiKey) -> bool:
        tenants, keys = self._k("tenants"), self._k("keys")

        async def change(pipe: Any) -> bool:
            owner = await self._current(pipe, "tenants", key.tenant_id, tenant_record)
            if owner is None or not key.held_by(owner):
                await self._call(pipe.reset())
                return False
            pipe.multi()
            pipe.hset(keys, key.key_hash, json.dumps(asdict(key)))
            pipe.incr(self._k("version"))
            await self._call(pipe.execute())
            return True

        # Only the tenants table is watched: a write of another key cannot make this one
        # an orphan.
        return await self._watching((tenants,), change, f"key {key.key_id!r} could not be "
                                    f"stored: tenant records kept changing")

    async def delete_key(self, key_hash: str) -> None:
        await self._delete("keys", key_hash)

    async def swap_adapter(self, name: str, expected: AdapterRecord | None,
                           new: AdapterRecord | None) -> bool:
        return await self._swap("adapters", name, expected, new, adapter_record)

    async def _swap(self, table: str, name: str, expected: R | None, new: R | None,
                    build: Builder[R]) -> bool:
        """Compare and set one record of ``table`` (StateStore.swap_adapter's semantics)."""
        key = self._k(table)

        async def change(pipe: Any) -> bool:
            current = await self._current(pipe, table, name, build)
            if current != expected:
                await self._call(pipe.reset())
                return False
            pipe.multi()
            if new is None:
                pipe.hdel(key, name)
            else:
                pipe.hset(key, name, json.dumps(asdict(new)))
            pipe.incr(self._k("version"))
            await self._call(pipe.execute())
            return True

        return await self._watching((key,), change, f"{table} record {name!r} could not be "
                                    f"written: its table kept changing")

    async def _current(self, pipe: Any, table: str, name: str, build: Builder[R]) -> R | None:
        """The record under ``name`` in ``table`` as a watching pipeline reads it (None:
        there is none, or it does not parse)."""
        raw = await self._call(pipe.hget(self._k(table), name))
        return None if raw is None else self._parse(table, name, raw, build)

    async def _watching(self, keys: tuple[str, ...],
                        change: Callable[[Any], Awaitable[T]], failure: str) -> T:
        """change(pipe) as one optimistic transaction: WATCH keys, read, MULTI, write,
        EXEC; started over (WATCH_ATTEMPTS at most) while another write to them races it."""
        async with self._redis.pipeline(transaction=True) as pipe:
            for _ in range(WATCH_ATTEMPTS):
                try:
                    await self._call(pipe.watch(*keys))
                    return await change(pipe)
                except WatchError:
                    continue
        raise StoreUnavailable(f"redis at {self.url}: {failure}")

    async def delete_adapter(self, name: str) -> None:
        await self._delete("adapters", name)

    # ------------------------------------------------------------- rate limits
    def _rate_keys(self, tenant_id: str) -> list[str]:
        return [self._k(f"rl:{tenant_id}:req"), self._k(f"rl:{tenant_id}:tok")]

    async def _script(self, script: Any, keys: list[str], now: float | None,
                      *args: Any) -> Any:
        now = time.time() if now is None else now
        return await self._call(script(keys=keys, args=[repr(float(now)), sw.WINDOW_S,
                                                        sw.SPAN_S, *args]))

    async def admit(self, key_hash: str | None, tenant_id: str, rpm: int | None,
                    tpm: int | None, now: float | None = None) -> Admission:
        now = time.time() if now is None else now
        code, value, *used = await self._script(
            self._admit, [self._k("keys"), *self._rate_keys(tenant_id)], now, key_hash or "",
            -1 if rpm is None else rpm, -1 if tpm is None else tpm)
        admission = _admission(int(code), int(value), now)
        if not admission.allowed:
            return admission
        return replace(admission, requests_used=int(used[0]), tokens_used=int(used[1]))

    async def reserve(self, tenant_id: str, tokens: int, tpm: int,
                      now: float | None = None) -> Admission:
        now = time.time() if now is None else now
        code, value, *used = await self._script(self._reserve, self._rate_keys(tenant_id)[1:],
                                                now, tokens, tpm)
        admission = _admission(int(code), int(value), now)
        return replace(admission, tokens_used=int(used[0])) if admission.allowed else admission

    async def charge(self, tenant_id: str, tokens: int, second: int,
                     now: float | None = None) -> None:
        await self._script(self._add, self._rate_keys(tenant_id)[1:], now, second, tokens)

    async def refund(self, tenant_id: str, second: int, now: float | None = None) -> None:
        await self._script(self._add, self._rate_keys(tenant_id)[:1], now, second, -1)

    # ---------------------------------------------------------------- engines
    async def register_engine(self, url: str, ttl_s: float) -> None:
        await self._call(register(self._redis, self._k(REGISTRY_KEY), url, ttl_s))

    async def engines(self) -> list[str]:
        key = self._k(REGISTRY_KEY)
        now = time.time()
        await self._call(self._redis.zremrangebyscore(key, "-inf", now))
        return sorted(await self._call(self._redis.zrangebyscore(key, now, "+inf")))

    async def close(self) -> None:
        await self._redis.aclose()


def _admission(code: int, value: int, now: float) -> Admission:
    if code > 0:
        return Admission(True, value)
    return Admission(False, sw.second_of(now), _REFUSED[code], value)


def _field(value: str, name: str) -> Any:
    """One field of a stored JSON record (None if the record does not parse)."""
    try:
        data = json.loads(value)
    except ValueError:
        return None
    return data.get(name) if isinstance(data, dict) else None


def _tenant_adapters(adapters: dict[str, str], tenant_id: str
                     ) -> tuple[list[str], dict[str, str]]:
    """The adapters tenant_id owns (sorted names), and the others shared with it, rewritten
    without it. The raw JSON is edited, so fields of a newer version survive."""
    owned, unshared = [], {}
    for name, value in adapters.items():
        if _field(value, "owner") == tenant_id:
            owned.append(name)
            continue
        shared = _field(value, "shared_with")
        if isinstance(shared, list) and tenant_id in shared:
            data = json.loads(value)
            data["shared_with"] = [t for t in shared if t != tenant_id]
            unshared[name] = json.dumps(data)
    return sorted(owned), unshared
