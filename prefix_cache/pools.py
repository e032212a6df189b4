"""Per-adapter KV pools: one shared block pool, accounted per owner (adapter or base).

This is the one place the cache's counters live: blocks used and cached, evictions and
prefix lookups (queries, query and hit tokens) per pool; global figures are sums over pools
(engine/metrics.py PrefixCacheStats).

Every block in use or cached belongs to the pool of the request that allocated it; blocks
are never shared across pools (their hashes differ by adapter identity). Each pool has:

    floor   blocks reserved for it: other pools may not allocate into its unused floor
    cap     most blocks it may hold in use; at the cap it preempts its own requests first
    share   its fair part of the cache: cached blocks of pools above it are evicted first
            (configured share = cap; otherwise total / number of pools holding blocks)

A pool goes with its adapter (forget): its figures leave stats(), hence /metrics, and its
lookup and eviction counts move to ``retired``, so the global counters never go down.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

BASE_POOL = "base"
_COUNTS = ("evictions", "queries", "query_tokens", "hit_tokens")
"""The monotonic counters of a pool (PoolAccounting attributes and PoolStats fields)."""


@dataclass(frozen=True)
class PoolStats:
    """Figures of one pool."""

    used_blocks: int
    cached_blocks: int
    """Free blocks that still hold reusable KV (evictable)."""
    evictions: int
    queries: int
    """Prefix lookups (one per admitted request while caching is on)."""
    query_tokens: int
    hit_tokens: int
    floor_blocks: int
    cap_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PoolAccounting:
    """Counters and limits of every pool; the block cache keeps them current."""

    def __init__(self, num_blocks: int,
                 shares: tuple[tuple[str, float, float], ...] = (),
                 default_cap: float = 1.0) -> None:
        self.num_blocks = num_blocks
        self._limits = {name: (int(floor * num_blocks), int(cap * num_blocks))
                        for name, floor, cap in shares}
        self._default_cap = max(1, int(default_cap * num_blocks))
        self.used: Counter[str] = Counter()
        self.cached: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.queries: Counter[str] = Counter()
        self.query_tokens: Counter[str] = Counter()
        self.hit_tokens: Counter[str] = Counter()
        self.retired: Counter[str] = Counter()
        """Counts of forgotten pools, by counter name (evictions, queries, ...)."""

    def floor(self, pool: str) -> int:
        return self._limits[pool][0] if pool in self._limits else 0

    def cap(self, pool: str) -> int:
        return self._limits[pool][1] if pool in self._limits else self._default_cap

    def reserved_for_others(self, pool: str) -> int:
        """Free blocks this pool must leave alone: the unused floors of the other pools."""
        return sum(max(0, floor - self.used[name]) for name, (floor, _) in self._limits.items()
                   if name != pool)

    def floors_of_others(self, pool: str) -> int:
        return sum(floor for name, (floor, _) in self._limits.items() if name != pool)

    def most_over_share(self) -> str | None:
        """The pool with cached blocks that exceeds its share the most, if any does."""
        holders = [p for p in set(self.used) | set(self.cached)
                   if self.used[p] + self.cached[p] > 0]
        fair = self.num_blocks // max(1, len(holders))
        best, best_excess = None, 0
        for pool in holders:
            if not self.cached[pool]:
                continue
            share = self._limits[pool][1] if pool in self._limits else fair
            excess = self.used[pool] + self.cached[pool] - share
            if excess > best_excess:
                best, best_excess = pool, excess
        return best

    def record_lookup(self, pool: str, query_tokens: int, hit_tokens: int) -> None:
        """One prefix lookup of a newly admitted request of ``pool``."""
        self.queries[pool] += 1
        self.query_tokens[pool] += query_tokens
        self.hit_tokens[pool] += hit_tokens

    def forget(self, pool: str) -> bool:
        """Drop an unloaded adapter's pool, once it holds no block (the cache evicted its
        cached ones first); False, keeping it, for base, a configured pool (its limits
        outlive any adapter) or one that still holds blocks."""
        if (pool == BASE_POOL or pool in self._limits
                or self.used[pool] or self.cached[pool]):
            return False
        for name in _COUNTS:
            self.retired[name] += getattr(self, name).pop(pool, 0)
        self.used.pop(pool, None)
        self.cached.pop(pool, None)
        return True

    def retired_stats(self) -> PoolStats:
        """What forgotten pools counted: the part of the global counters no pool shows."""
        return PoolStats(0, 0, floor_blocks=0, cap_blocks=0,
                         **{name: self.retired[name] for name in _COUNTS})

    def stats(self) -> dict[str, PoolStats]:
        names = set(self.used) | set(self.cached) | set(self.query_tokens) | set(self._limits)
        return {
            name: PoolStats(used_blocks=self.used[name], cached_blocks=self.cached[name],
                            evictions=self.evictions[name], queries=self.queries[name],
                            query_tokens=self.query_tokens[name],
                            hit_tokens=self.hit_tokens[name], floor_blocks=self.floor(name),
                            cap_blocks=self.cap(name))
            for name in sorted(names)
        }
