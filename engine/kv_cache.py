"""Paged KV-cache bookkeeping: block tables over a prefix-caching block pool, swap space.

Only ids live here; the tensors the ids index belong to the model runner. A request's KV
for token position p lives in block ``block_table[p // block_size]`` at offset
``p % block_size``:

    positions  [0 ........ bs-1][bs ...... 2bs-1][2bs .. n-1   ]
    blocks      block_table[0]   block_table[1]   block_table[2] (partly filled)
    hashes      block_hashes[0]  block_hashes[1]  (none: only full blocks are hashed)

With prefix caching, the first blocks of a new request's table may be cached blocks shared
with other requests (ref counts > 1); a hit always leaves at least one token to compute
and ends on a block boundary, so the request's next chunk starts block-aligned.
"""

from __future__ import annotations

from collections import deque

from engine.request import Request
from prefix_cache.adaptive import AdaptiveConfig, HitRateTracker, PrefixCachingMode
from prefix_cache.cache import BlockCache, HashBlockCache
from prefix_cache.hashing import ROOT_HASH, chain_hashes
from prefix_cache.pools import BASE_POOL, PoolAccounting


def pool_of(request: Request) -> str:
    """The KV pool a request's blocks belong to: its adapter's, or the base model's."""
    return request.lora_name or BASE_POOL


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens."""
    return -(-num_tokens // block_size)


class BlockPool:
    """A fixed set of block ids with a free list, no sharing (the CPU swap space)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "caller must check num_free first"
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class KVCacheManager:
    """Block tables of running requests over the device pool, plus CPU swap space.

    allocate_slots() grows a request's table to cover its next tokens (taking refs on the
    cached prefix blocks found by find_cached_prefix()) or returns False without side
    effects. cache_full_blocks() registers blocks whose KV became complete. free() returns
    a request's blocks at once, last block first, so cached prefixes outlive suffixes.
    swap_out()/swap_in() move a table between the pools and return the (src, dst) block
    pairs the runner copies before the next forward.
    """

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0,
                 prefix_caching: PrefixCachingMode = "off",
                 adaptive: AdaptiveConfig | None = None, publish_every: int = 4,
                 pool_shares: tuple[tuple[str, float, float], ...] = (),
                 pool_default_cap: float = 1.0) -> None:
        self.block_size = block_size
        self.pools = PoolAccounting(num_blocks, pool_shares, pool_default_cap)
        self.pool: BlockCache = HashBlockCache(num_blocks, publish_every=publish_every,
                                               pools=self.pools)
        self.swap_pool = BlockPool(num_swap_blocks)
        self.tracker = HitRateTracker(prefix_caching, adaptive)
        self._tables: dict[str, list[int]] = {}
        self._swapped_tables: dict[str, list[int]] = {}
        self._num_inserted: dict[str, int] = {}  # leading table blocks already in the cache
        # Blocks being computed right now: hash -> request computing it. A new request whose
        # next block is here waits for it instead of computing it a second time.
        self._in_flight: dict[int, str] = {}
        self._in_flight_of: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ read access
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached ones included: they are evictable)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def caching_enabled(self) -> bool:
        return self.tracker.enabled

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def max_tokens_per_request(self, pool: str = BASE_POOL) -> int:
        """The most tokens (prompt + output) one request of ``pool`` can ever hold: the whole
        cache but the other pools' floors, within the pool's cap, with nothing else
        running. A request needs blocks_for(n) blocks, so n tokens fit iff n <= this."""
        blocks = min(self.pool.num_blocks - self.pools.floors_of_others(pool),
                     self.pools.cap(pool))
        return blocks * self.block_size

    # ------------------------------------------------------------------ prefix hits
    def _update_hashes(self, request: Request) -> list[int]:
        hashes = request.block_hashes
        if len(hashes) < request.num_tokens // self.block_size:
            hashes.extend(chain_hashes(request.all_token_ids, self.block_size,
                                       request.extra_keys, start=len(hashes),
                                       parent=hashes[-1] if hashes else ROOT_HASH))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks of the request's longest cached prefix, capped so that at least
        one token is left to compute. No side effects; empty when caching is off."""
        if not self.tracker.enabled or not request.reads_prefix_cache:
            return []
        hit = self.pool.match(self._update_hashes(request))
        return hit[:(request.num_tokens - 1) // self.block_size]

    def next_block_in_flight(self, request: Request, num_hit_blocks: int) -> bool:
        """True when the block after the hit is being computed by another request."""
        hashes = request.block_hashes
        if (not self.tracker.enabled or num_hit_blocks >= len(hashes)
                or not request.reads_prefix_cache):
            return False
        owner = self._in_flight.get(hashes[num_hit_blocks])
        return owner is not None and owner != request.request_id

    # ------------------------------------------------------------------- allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] | None = None) -> bool:
        """Cover positions up to num_computed + num_new_tokens, where num_computed counts the
        cached blocks for a request that has no table yet."""
        cached = cached_blocks or []
        table = self._tables.get(request.request_id, [])
        assert not (cached and table), "cached prefix only for a request without blocks"
        computed = len(cached) * self.block_size if cached else request.num_computed_tokens
        missing = blocks_for(computed + num_new_tokens, self.block_size) - len(table) - len(
            cached)
        # Cached blocks nobody holds sit in the free queue: taking them shrinks it.
        reclaimed = sum(1 for b in cached if self.pool.ref_count(b) == 0)
        pool = pool_of(request)
        if missing > self.pool.num_free - reclaimed - self.pools.reserved_for_others(pool):
            return False
        if self._over_cap(pool, reclaimed + max(0, missing)):
            return False
        if cached:
            self.pool.acquire(cached)
            table = list(cached)
            self._num_inserted[request.request_id] = len(cached)
        if missing > 0:
            table = table + self.pool.allocate(missing, pool)
        self._tables[request.request_id] = table
        return True

    def _over_cap(self, pool: str, extra_blocks: int) -> bool:
        return self.pools.used[pool] + extra_blocks > self.pools.cap(pool)

    def pool_at_cap(self, request: Request, num_new_tokens: int, start: int | None = None
                    ) -> bool:
        """Would covering num_new_tokens more (from ``start``, default the computed count)
        push the request's pool over its cap?"""
        table = self._tables.get(request.request_id, [])
        start = request.num_computed_tokens if start is None else start
        need = blocks_for(start + num_new_tokens, self.block_size)
        return self._over_cap(pool_of(request), max(0, need - len(table)))

    def note_admitted(self, request: Request, num_hit_tokens: int) -> None:
        """Record the lookup of a newly admitted request and mark its uncached prompt
        blocks as in flight."""
        if not self.tracker.enabled:
            self.tracker.on_admitted()
            return
        self.tracker.record(request.num_tokens, num_hit_tokens)
        self.pools.record_lookup(pool_of(request), request.num_tokens, num_hit_tokens)
        first = num_hit_tokens // self.block_size
        mine = [h for h in request.block_hashes[first:] if h not in self._in_flight]
        for h in mine:
            self._in_flight[h] = request.request_id
        if mine:
            self._in_flight_of[request.request_id] = mine

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks whose KV became complete with the last step."""
        if not self.tracker.enabled:
            return
        table = self._tables.get(request.request_id)
        if table is None:
            return
        done = self._num_inserted.get(request.request_id, 0)
        full = request.num_computed_tokens // self.block_size
        if full <= done:
            return
        hashes = self._update_hashes(request)
        stored: list[int] = []
        for i in range(done, full):
            if self.pool.insert(table[i], hashes[i], i):
                stored.append(i)
            if self._in_flight.get(hashes[i]) == request.request_id:
                del self._in_flight[hashes[i]]
        self._num_inserted[request.request_id] = full
        if stored and self.pool.events is not None:
            self._report_stored(request, stored)

    def _report_stored(self, request: Request, indices: list[int]) -> None:
        """Tell the event sink of newly cached blocks, one event per run of consecutive
        blocks (as vLLM does); a block another request cached first is not news."""
        assert self.pool.events is not None
        hashes, tokens, bs = request.block_hashes, request.all_token_ids, self.block_size
        start = indices[0]
        for k, i in enumerate(indices):
            if k + 1 == len(indices) or indices[k + 1] != i + 1:
                self.pool.events.stored(hashes[start:i + 1], hashes[start - 1] if start else None,
                                        tokens[start * bs:(i + 1) * bs], request.lora_name)
                if k + 1 < len(indices):
                    start = indices[k + 1]

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.release(table[::-1])
        swapped = self._swapped_tables.pop(request_id, None)
        if swapped:
            self.swap_pool.free(swapped)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._num_inserted.pop(request_id, None)
        for h in self._in_flight_of.pop(request_id, []):
            if self._in_flight.get(h) == request_id:
                del self._in_flight[h]

    # ------------------------------------------------------------------------- swap
    def swap_out(self, request_id: str, num_computed_tokens: int
                 ) -> list[tuple[int, int]] | None:
        """Copy the blocks holding the first num_computed_tokens to swap space and drop the
        request's device refs (blocks allocated for tokens not yet computed are simply
        released); None, with nothing changed, if swap space is short."""
        table = self._tables.get(request_id, [])
        keep = blocks_for(num_computed_tokens, self.block_size)
        if keep > self.swap_pool.num_free:
            return None
        cpu_blocks = self.swap_pool.allocate(keep)
        self._swapped_tables[request_id] = cpu_blocks
        self.pool.release(self._tables.pop(request_id, [])[::-1])
        self._forget(request_id)
        return list(zip(table[:keep], cpu_blocks, strict=True))

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move a swapped table back into fresh device blocks; the caller checked that
        num_free_blocks suffices."""
        request_id = request.request_id
        cpu_blocks = self._swapped_tables.pop(request_id)
        device_blocks = self.pool.allocate(len(cpu_blocks), pool_of(request))
        self._tables[request_id] = device_blocks
        self.swap_pool.free(cpu_blocks)
        return list(zip(cpu_blocks, device_blocks, strict=True))
