"""Engine discovery through the state store: engines announce themselves with a TTL
heartbeat, gateways add what is announced and drop what expired and stopped answering.

An engine (``loragate engine --register-redis-url URL``) re-registers every TTL/3, so one
missed beat does not drop it; a crashed engine disappears from the registry after the TTL,
while the gateway's health checks have usually ejected it long before.

Whoever can write the registry could otherwise announce their own server and receive every
tenant's prompts. So each entry is signed: the member stored in the sorted set is
``{"url", "exp", "sig"}`` (JSON), sig = HMAC-SHA256 keyed by the engine token over the URL
and the expiry (unix seconds). discover() uses only entries whose signature verifies and
whose signed expiry has not passed (an old entry copied back in is ignored once it expires).
Each beat adds a fresh member; the store drops members once their score (expiry) passes, so
an engine has at most a few live ones. The signature stops forged engines only: Redis holds
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

from gateway.instances import InstancePool
from gateway.store import StateStore, StoreUnavailable

log = logging.getLogger(__name__)
HEARTBEAT_TTL_S = 10.0
WARN_EVERY_S = 60.0
"""At most one warning about unverifiable registry entries per this many seconds."""
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


async def heartbeat(redis_url: str, engine_url: str, token: str,
                    ttl_s: float = HEARTBEAT_TTL_S) -> None:
    """Register engine_url, signed with the engine token, every ttl_s / 3, forever (cancel
    to stop)."""
    from gateway.redis_store import RedisStore

    store = RedisStore(redis_url)
    try:
        while True:
            try:
                # A second past the store's score for the member: while the store
                # returns it, its signed expiry has not passed.
                exp = math.ceil(time.time() + ttl_s) + 1
                await store.register_engine(signed_entry(token, engine_url, exp), ttl_s)
            except StoreUnavailable as exc:
                log.warning("engine registry unreachable: %s", exc)
            await asyncio.sleep(ttl_s / 3)
    finally:
        with contextlib.suppress(Exception):
            await store.close()


async def discover(store: StateStore, pool: InstancePool, static: set[str],
                   interval_s: float, token: str) -> None:
    """Keep the pool in step with the registry (instances given on the command line stay).
    Only entries signed with token count; others are ignored with a rate-limited warning."""
    warned_at = -math.inf
    while True:
        try:
            members = await store.engines()
        except StoreUnavailable:
            members = None  # keep what we have until the registry answers again
        if members is not None:
            now = time.time()
            urls = {m: verified_url(token, m, now) for m in members}
            announced = {url for url in urls.values() if url is not None}
            bad = [m for m, url in urls.items() if url is None]
            if bad and time.monotonic() - warned_at >= WARN_EVERY_S:
                warned_at = time.monotonic()
                log.warning("ignoring %d engine registry entr%s without a valid signature "
                            "(forged, or an engine with another --engine-token), e.g. %.200r",
                            len(bad), "y" if len(bad) == 1 else "ies", bad[0])
            for url in sorted(announced - set(pool.instances)):
                log.info("discovered engine %s", url)
                pool.add_instance(url)
            for url in sorted(set(pool.instances) - announced - static):
                if not pool.instances[url].healthy:
                    log.info("engine %s left the registry", url)
                    pool.remove_instance(url)
        await asyncio.sleep(interval_s)

