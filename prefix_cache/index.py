"""Router-side prefix index: which engine holds the longest prefix of a request.

Engines publish sparse chain hashes (every Nth block, see HashBlockCache.publish); the
gateway hashes a request's prompt with the same function (prefix_cache.hashing) and looks
for the deepest sparse hash each engine holds. A chain hash covers its whole prefix, so the
deepest hit is the match length; eviction goes suffix-first, so a deeper hit without the
shallower ones is rare and still a true match of the blocks it names.

Publishes arrive with the gateway's next poll, after the engine has computed the blocks; a
request that shares a prefix with one routed a moment ago (a burst on a new document, a
chat's next turn sent quickly) would not see it yet. So the gateway also notes the chain of
every request it routes (``note_routed``): those hashes count as held by that engine for
``routed_ttl_s`` seconds, or until the engine's own publish confirms or withdraws them.
This is the same bet as the prefix-aware routers that track what they sent where (SGLang's
cache-aware router): an engine that was sent a prefix is about to have it cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prefix_cache.cache import PrefixUpdate
from prefix_cache.hashing import ExtraKey, chain_hashes, sparse_chain

EXTERNAL_MASK = (1 << 64) - 1
"""KV events carry block hashes cut to their low 64 bits (engine/kv_events.py)."""


@dataclass
class _EngineEntry:
    hashes: set[int] = field(default_factory=set)
    """Published and not withdrawn."""
    routed: dict[int, float] = field(default_factory=dict)
    """Noted by note_routed, not yet published: hash -> when noted. Insertion order is
    noting order (a re-noted hash moves to the end), so expiry pops from the front."""
    cursor: int = 0
    events: bool = False
    """Fed by the engine's KV events (every block, exact): its polled publishes are ignored."""
    external: set[int] = field(default_factory=set)
    """With events: the 64-bit hashes (EXTERNAL_MASK) of every block it holds."""

    def expire(self, before: float) -> None:
        while self.routed:
            oldest = next(iter(self.routed))
            if self.routed[oldest] >= before:
                break
            del self.routed[oldest]


class PrefixIndex:
    """Per-engine sets of published sparse hashes, kept current by apply(), plus the
    hashes of requests recently routed to each engine (note_routed)."""

    def __init__(self, block_size: int, publish_every: int, routed_ttl_s: float = 20.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.publish_every = publish_every
        self.routed_ttl_s = routed_ttl_s
        self._clock = clock
        self._engines: dict[str, _EngineEntry] = {}

    def cursor(self, engine_id: str) -> int:
        """The cursor to ask engine_id's publish() with next."""
        entry = self._engines.get(engine_id)
        return entry.cursor if entry else 0

    def apply(self, engine_id: str, update: PrefixUpdate) -> None:
        entry = self._engines.setdefault(engine_id, _EngineEntry())
        if entry.events:  # the events already said it, block by block
            entry.cursor = update.cursor
            return
        if update.full:
            entry.hashes = set(update.added)
        else:
            entry.hashes.update(update.added)
            entry.hashes.difference_update(update.removed)
        # The engine's word replaces the guess: published hashes are held, withdrawn ones
        # are gone whatever was routed there since.
        for h in (*update.added, *update.removed):
            entry.routed.pop(h, None)
        entry.expire(self._clock() - self.routed_ttl_s)
        entry.cursor = update.cursor

    def apply_events(self, engine_id: str, stored: Iterable[int], removed: Iterable[int],
                     cleared: bool = False) -> None:
        """An engine's KV events, in order within one call (removals after storing, as a
        batch's events are applied: callers split batches where the order matters): 64-bit
        block hashes it now holds or no longer holds. From the first call on, the engine's
        polled publishes are ignored."""
        entry = self._engines.setdefault(engine_id, _EngineEntry())
        if not entry.events:
            entry.events, entry.hashes = True, set()
        if cleared:
            entry.external.clear()
        stored, removed = set(stored), set(removed)
        entry.external |= stored
        entry.external -= removed
        if entry.routed:  # the engine's word replaces the guess, as in apply()
            for h in [h for h in entry.routed if h & EXTERNAL_MASK in stored | removed]:
                del entry.routed[h]

    def note_routed(self, engine_id: str, chain: Sequence[tuple[int, int]]) -> None:
        """A request with this chain (from request_chain) was sent to engine_id: count its
        hashes as held there until published, withdrawn or ``routed_ttl_s`` old (0: never)."""
        if self.routed_ttl_s <= 0:
            return
        entry = self._engines.setdefault(engine_id, _EngineEntry())
        now = self._clock()
        entry.expire(now - self.routed_ttl_s)
        for _, h in chain:
            if h not in entry.hashes:
                entry.routed.pop(h, None)
                entry.routed[h] = now

    def size(self, engine_id: str) -> int:
        """Sparse hashes engine_id has published and not withdrawn (routed ones aside); with
        KV events, every block it holds."""
        entry = self._engines.get(engine_id)
        if entry is None:
            return 0
        return len(entry.external) if entry.events else len(entry.hashes)

    def follows_events(self, engine_id: str) -> bool:
        entry = self._engines.get(engine_id)
        return entry is not None and entry.events

    def remove_engine(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)

    def request_chain(self, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
                      ) -> list[tuple[int, int]]:
        """The (block index, hash) pairs of a prompt that engines may have published."""
        return sparse_chain(chain_hashes(token_ids, self.block_size, extra_keys),
                            self.publish_every)

    def match(self, chain: Sequence[tuple[int, int]], engine_ids: Iterable[str] | None = None
              ) -> dict[str, int]:
        """Matched prefix length in tokens per engine (0 when nothing matches)."""
        ids = list(self._engines) if engine_ids is None else list(engine_ids)
        result: dict[str, int] = {}
        expired_before = self._clock() - self.routed_ttl_s
        for engine_id in ids:
            entry = self._engines.get(engine_id)
            matched = 0
            if entry is not None:
                held = entry.hashes
                if entry.events:  # compare as the events name blocks
                    held = {h for _, h in chain if h & EXTERNAL_MASK in entry.external}
                for index, h in reversed(chain):
                    if h in held or entry.routed.get(h, expired_before) > expired_before:
                        matched = (index + 1) * self.block_size
                        break
            result[engine_id] = matched
        return result

    def longest_match(self, chain: Sequence[tuple[int, int]],
                      engine_ids: Iterable[str] | None = None) -> tuple[str | None, int]:
        """The engine with the longest match (None when no engine matches anything)."""
        matches = self.match(chain, engine_ids)
        best = max(matches.items(), key=lambda kv: kv[1], default=(None, 0))
        return (best[0], best[1]) if best[1] > 0 else (None, 0)
