"""RedisStore: the StateStore of several gateway replicas (redis-py asyncio).

Layout (prefix ``lg:`` by default):
    lg:version                 INCR on every write; replicas reload their view when it moves
    lg:tenants / lg:keys / lg:adapters   hashes of JSON records (keys by SHA-256 of the key)
    lg:rl:{tenant}:{window}    hash {req, tok}, expires two windows later
    lg:engines                 sorted set url -> expiry (unix seconds): engine heartbeats

admit() is one Lua script (key still valid? tokens under TPM? requests under RPM? count it),
so two gateways can never both take the last request of a window. The script touches keys
of different hash slots: it needs a standalone Redis (or one shard), not Redis Cluster.
Every connection or timeout error becomes StoreUnavailable, fast: no retries and short
socket timeouts, because the gateway's failure policy (gateway/limits.py) has a better
answer than waiting.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.store import WINDOW_S, Admission, Snapshot, StoreUnavailable, retry_after, window_of
from gateway.tenancy import AdapterRecord, ApiKey, Tenant

_ADMIT = """
if ARGV[1] ~= '' and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return -3 end
local req = tonumber(redis.call('HGET', KEYS[2], 'req') or '0')
local tok = tonumber(redis.call('HGET', KEYS[2], 'tok') or '0')
local rpm = tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
if tpm >= 0 and tok >= tpm then return -2 end
if rpm >= 0 and req >= rpm then return -1 end
redis.call('HINCRBY', KEYS[2], 'req', 1)
redis.call('EXPIRE', KEYS[2], ARGV[4])
return req + 1
"""
_REFUSED = {-1: "rpm", -2: "tpm", -3: "revoked"}


class RedisStore:
    """StateStore over one Redis server (see the module docstring)."""

    def __init__(self, url: str, prefix: str = "lg:", timeout_s: float = 0.5) -> None:
        self.url = url
        self.prefix = prefix
        self._redis = aioredis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self._admit = self._redis.register_script(_ADMIT)

    def _k(self, name: str) -> str:
        return self.prefix + name

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis at {self.url}: {type(exc).__name__}: {exc}") from exc

    async def snapshot(self) -> Snapshot:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(self._k("version"))
            pipe.hgetall(self._k("tenants"))
            pipe.hgetall(self._k("keys"))
            pipe.hgetall(self._k("adapters"))
            version, tenants, keys, adapters = await self._call(pipe.execute())
        return Snapshot(
            version=int(version or 0),
            tenants={k: _tenant(json.loads(v)) for k, v in tenants.items()},
            keys={k: ApiKey(**json.loads(v)) for k, v in keys.items()},
            adapters={k: _adapter(json.loads(v)) for k, v in adapters.items()})

    async def version(self) -> int:
        return int(await self._call(self._redis.get(self._k("version"))) or 0)

    async def _write(self, op: str, table: str, field: str, value: str | None = None) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            if op == "set":
                assert value is not None
                pipe.hset(self._k(table), field, value)
            else:
                pipe.hdel(self._k(table), field)
            pipe.incr(self._k("version"))
            await self._call(pipe.execute())

    async def put_tenant(self, tenant: Tenant) -> None:
        await self._write("set", "tenants", tenant.tenant_id, json.dumps(asdict(tenant)))

    async def delete_tenant(self, tenant_id: str) -> None:
        keys = await self._call(self._redis.hgetall(self._k("keys")))
        owned = [h for h, v in keys.items() if json.loads(v)["tenant_id"] == tenant_id]
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._k("tenants"), tenant_id)
            if owned:
                pipe.hdel(self._k("keys"), *owned)
            pipe.incr(self._k("version"))
            await self._call(pipe.execute())

    async def put_key(self, key: ApiKey) -> None:
        await self._write("set", "keys", key.key_hash, json.dumps(asdict(key)))

    async def delete_key(self, key_hash: str) -> None:
        await self._write("del", "keys", key_hash)

    async def put_adapter(self, adapter: AdapterRecord) -> None:
        await self._write("set", "adapters", adapter.name, json.dumps(asdict(adapter)))

    async def delete_adapter(self, name: str) -> None:
        await self._write("del", "adapters", name)

    async def admit(self, key_hash: str | None, tenant_id: str, rpm: int | None,
                    tpm: int | None, now: float | None = None) -> Admission:
        now = time.time() if now is None else now
        window = window_of(now)
        result = int(await self._call(self._admit(
            keys=[self._k("keys"), self._k(f"rl:{tenant_id}:{window}")],
            args=[key_hash or "", -1 if rpm is None else rpm, -1 if tpm is None else tpm,
                  2 * WINDOW_S])))
        if result < 0:
            reason = _REFUSED[result]
            return Admission(False, window, reason,
                             0 if reason == "revoked" else retry_after(now))
        return Admission(True, window)

    async def charge(self, tenant_id: str, tokens: int, window: int) -> None:
        key = self._k(f"rl:{tenant_id}:{window}")
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "tok", tokens)
            pipe.expire(key, 2 * WINDOW_S)
            await self._call(pipe.execute())

    async def refund(self, tenant_id: str, window: int) -> None:
        await self._call(self._redis.hincrby(self._k(f"rl:{tenant_id}:{window}"), "req", -1))

    async def register_engine(self, url: str, ttl_s: float) -> None:
        await self._call(self._redis.zadd(self._k("engines"), {url: time.time() + ttl_s}))

    async def engines(self) -> list[str]:
        key = self._k("engines")
        now = time.time()
        await self._call(self._redis.zremrangebyscore(key, "-inf", now))
        return sorted(await self._call(self._redis.zrangebyscore(key, now, "+inf")))

    async def close(self) -> None:
        await self._redis.aclose()


def _tenant(data: dict[str, Any]) -> Tenant:
    return Tenant(**data)


def _adapter(data: dict[str, Any]) -> AdapterRecord:
    return AdapterRecord(**{**data, "shared_with": tuple(data.get("shared_with") or ())})
