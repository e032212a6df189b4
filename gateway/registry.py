"""Engine discovery through the state store: gateways add the engines announced in the
signed registry (engine/http/registry.py) and drop what expired and stopped answering."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from engine.http.registry import verified_url
from gateway.instances import InstancePool
from gateway.store import StateStore, StoreUnavailable

log = logging.getLogger(__name__)
WARN_EVERY_S = 60.0
"""At most one warning about unverifiable registry entries per this many seconds."""


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

