"""Engine discovery through the state store: engines announce themselves with a TTL
heartbeat, gateways add what is announced and drop what expired and stopped answering.

An engine (``loragate engine --register-redis-url URL``) re-registers every TTL/3, so one
missed beat does not drop it; a crashed engine disappears from the registry after the TTL,
while the gateway's health checks have usually ejected it long before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.instances import InstancePool
from gateway.store import StateStore, StoreUnavailable

log = logging.getLogger(__name__)
HEARTBEAT_TTL_S = 10.0


async def heartbeat(redis_url: str, engine_url: str, ttl_s: float = HEARTBEAT_TTL_S) -> None:
    """Register engine_url in the registry every ttl_s / 3, forever (cancel to stop)."""
    from gateway.redis_store import RedisStore

    store = RedisStore(redis_url)
    try:
        while True:
            try:
                await store.register_engine(engine_url, ttl_s)
            except StoreUnavailable as exc:
                log.warning("engine registry unreachable: %s", exc)
            await asyncio.sleep(ttl_s / 3)
    finally:
        with contextlib.suppress(Exception):
            await store.close()


async def discover(store: StateStore, pool: InstancePool, static: set[str],
                   interval_s: float) -> None:
    """Keep the pool in step with the registry (instances given on the command line stay)."""
    while True:
        try:
            announced = set(await store.engines())
        except StoreUnavailable:
            announced = None  # keep what we have until the registry answers again
        if announced is not None:
            for url in sorted(announced - set(pool.instances)):
                log.info("discovered engine %s", url)
                pool.add_instance(url)
            for url in sorted(set(pool.instances) - announced - static):
                if not pool.instances[url].healthy:
                    log.info("engine %s left the registry", url)
                    pool.remove_instance(url)
        await asyncio.sleep(interval_s)
