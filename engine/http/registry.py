"""The signed engine registry, engine side: an engine announces itself in the gateways'
Redis with a TTL heartbeat (``loragate engine --register-redis-url URL``); gateways discover
it there (gateway/registry.py).

An engine re-registers every TTL/3, so one missed beat does not drop it; a draining engine
(SIGTERM) withdraws its entries at once; a crashed engine disappears from the registry
after the TTL, while the gateway's health checks have usually ejected it long before.

Whoever can write the registry could otherwise announce their own server and receive every
tenant's prompts. So each entry is signed: the member stored in the sorted set is
``{"url", "exp", "sig"}`` (JSON), sig = HMAC-SHA256 keyed by the engine token over the URL
and the expiry (unix seconds). Gateways use only entries whose signature verifies and whose
signed expiry has not passed (an old entry copied back in is ignored once it expires). Each
beat adds a fresh member; the store drops members once their score (expiry) passes, so an
engine has at most a few live ones. The signature stops forged engines only: Redis holds
tenants, key hashes and limits too, so beyond one host it needs AUTH and TLS (rediss://).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
HEARTBEAT_TTL_S = 10.0
DRAIN_CHECK_S = 0.25
"""How often the heartbeat looks at the engine's draining flag between beats."""
REGISTRY_KEY = "engines"
"""The sorted set (member -> expiry, unix seconds) under the store's key prefix."""
DEFAULT_PREFIX = "lg:"
_DOMAIN = b"loragate-engine-registry-v1"
"""Prefix of every signed message: a signature made for anything else never verifies."""


def _signature(token: str, url: str, exp: int) -> str:
    message = _DOMAIN + json.dumps([url, exp], separators=(",", ":")).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def signed_entry(token: str, url: str, exp: int) -> str:
    """The registry member announcing url until exp (unix seconds)."""
    return json.dumps({"url": url, "exp": exp, "sig": _signature(token, url, exp)},
                      separators=(",", ":"), sort_keys=True)


def verified_url(token: str, member: str, now: float) -> str | None:
    """The URL of a registry member signed with token and not expired; None otherwise."""
    try:
        entry = json.loads(member)
        url, exp, sig = entry["url"], entry["exp"], entry["sig"]
    except (ValueError, TypeError, KeyError):
        return None
    if not (isinstance(url, str) and type(exp) is int and isinstance(sig, str)):
        return None
    if not hmac.compare_digest(sig.encode(), _signature(token, url, exp).encode()):
        return None
    return url if exp >= now else None


async def register(client: aioredis.Redis, key: str, member: str, ttl_s: float) -> None:
    """Announce ``member`` in the registry set ``key`` for ttl_s seconds."""
    await client.zadd(key, {member: time.time() + ttl_s})


def registry_client(redis_url: str) -> aioredis.Redis:
    """A Redis client for the heartbeat; ValueError without the URL (it may hold a
    password) when the URL is malformed."""
    try:
        return aioredis.from_url(redis_url, decode_responses=True, socket_timeout=0.5,
                                 socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    except ValueError:
        raise ValueError("invalid --register-redis-url: check its scheme, host, port and "
                         "database") from None


async def withdraw(client: aioredis.Redis, key: str, members: list[str]) -> None:
    """Remove ``members`` from the registry set ``key`` (a draining engine's own)."""
    if members:
        await client.zrem(key, *members)


async def heartbeat(client: aioredis.Redis, engine_url: str, token: str,
                    ttl_s: float = HEARTBEAT_TTL_S,
                    draining: Callable[[], bool] = lambda: False) -> None:
    """Register engine_url, signed with the engine token, every ttl_s / 3 until
    ``draining()`` turns true or the task is cancelled; then withdraw every entry it wrote,
    so gateways stop discovering it at once instead of after the TTL."""
    key = DEFAULT_PREFIX + REGISTRY_KEY
    written: dict[str, int] = {}  # member -> its signed expiry
    try:
        while not draining():
            try:
                # A second past the store's score for the member: while the store
                # returns it, its signed expiry has not passed.
                exp = math.ceil(time.time() + ttl_s) + 1
                member = signed_entry(token, engine_url, exp)
                # Remembered before the write: a reply that times out may follow a write
                # that landed, and the drain must withdraw that member too.
                written[member] = exp
                await register(client, key, member, ttl_s)
            except (RedisError, OSError) as exc:  # the text may name the server: not logged
                log.warning("engine registry unreachable: %s", type(exc).__name__)
            now = time.time()
            for member in [m for m, e in written.items() if e < now]:
                del written[member]  # expired: the store ignores it already
            # Wake often enough to withdraw soon after a drain starts.
            beat_at = time.monotonic() + ttl_s / 3
            while not draining() and time.monotonic() < beat_at:
                await asyncio.sleep(min(DRAIN_CHECK_S, ttl_s / 3))
    finally:
        try:
            async with asyncio.timeout(2.0):
                await withdraw(client, key, list(written))
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("engine registry entries not withdrawn (%s): they expire within "
                        "%.0f s", type(exc).__name__, ttl_s)
        with contextlib.suppress(Exception):
            await client.aclose()
