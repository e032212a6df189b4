"""Prefix cache over the engine's block pool: ref counts, hash -> block map, LRU eviction.

Every block id in [0, num_blocks) is in exactly one state:

    in use        ref_count > 0                 (held by one or more running requests)
    free, cached  ref_count == 0, has a hash    (reusable by a later hit; evictable)
    free, empty   ref_count == 0, no hash

Free blocks of both kinds sit in one LRU queue; allocation takes the head and drops its
hash (lazy eviction), so ``num_free`` counts cached blocks too. After all requests end,
num_free == num_blocks, of which num_cached still hold reusable KV.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prefix_cache.pools import BASE_POOL, PoolAccounting


@dataclass(frozen=True)
class PrefixUpdate:
    """Changes to an engine's published sparse hashes since a cursor (see publish())."""

    cursor: int
    full: bool
    """True: ``added`` is the complete current set (the old cursor fell out of the log)."""
    added: list[int]
    removed: list[int]


class CacheEventSink(Protocol):
    """Told of every change to the set of cached hashes, in order, so that a router can
    keep an exact copy of it (engine/kv_events.py publishes them as vLLM's KV events)."""

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
               lora_name: str | None) -> None:
        """Consecutive blocks of one chain became cached (parent: the hash before them)."""
        ...

    def removed(self, block_hash: int) -> None: ...

    def cleared(self) -> None: ...


class BlockCache(Protocol):
    """A block pool whose freed blocks keep their KV reusable under a content hash.

    Contract (callers: the KV manager, from the engine's one step thread; no locking):
    - match() has no side effects: it neither takes refs nor touches LRU order.
    - acquire() takes a ref on blocks returned by match() in the same step, before any
      allocate() that could evict them.
    - allocate(n) requires n <= num_free; it returns blocks with ref_count 1 and evicts
      the least recently freed cached blocks it takes.
    - release() drops one ref per block; blocks reaching 0 join the LRU tail in the order
      given, so callers pass a request's blocks last-first: a shared prefix, released
      last, outlives the suffixes that hang off it.
    - insert() registers a block whose KV is complete; if the hash is already cached by
      another block the call is a no-op (returns False) and the caller keeps its own copy.
    - every count (used, cached, evictions, per pool) is kept in ``pools``, nowhere else.
    - publish() reports the sparse hashes added and removed since a cursor (see PrefixUpdate).
    - ``events``, when set, is told of every eviction here; the KV manager, which knows
      the tokens, tells it of insertions.
    """

    num_blocks: int
    pools: PoolAccounting
    events: CacheEventSink | None

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest prefix of ``hashes`` that is cached."""
        ...

    def acquire(self, block_ids: Sequence[int]) -> None: ...

    def allocate(self, n: int, pool: str = BASE_POOL) -> list[int]:
        """n fresh blocks owned by ``pool`` (see prefix_cache.pools)."""
        ...

    def release(self, block_ids: Sequence[int]) -> None: ...

    def insert(self, block_id: int, block_hash: int, block_index: int) -> bool:
        """Cache a computed full block; block_index is its position in the request's chain."""
        ...

    @property
    def num_free(self) -> int: ...

    @property
    def num_cached(self) -> int: ...

    def ref_count(self, block_id: int) -> int: ...

    def publish(self, cursor: int = 0) -> PrefixUpdate: ...

    def drop_pool(self, pool: str) -> None:
        """``pool``'s adapter was unloaded: evict its cached blocks, forget its figures."""
        ...


@dataclass(slots=True)
class Block:
    """One block id's bookkeeping (its KV lives in the model runner's tensors)."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    """Set while the block's KV is cached under this hash (in use or free)."""
    chain_index: int = 0
    """Position of the block in the chain of the request that cached it."""
    pool: str = BASE_POOL
    """Owner of the block since its last allocation (prefix_cache.pools)."""


class _Blocks(dict[int, Block]):
    """block id in [0, num_blocks) -> its Block, created on first access."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.num_blocks = num_blocks

    def __missing__(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} is not in [0, {self.num_blocks})")
        block = self[block_id] = Block(block_id)
        return block


class HashBlockCache:
    """BlockCache with a flat hash -> block dict (vLLM-style); a radix tree could stand
    beside it behind the same protocol.

    The free queue is an OrderedDict used as a doubly linked list: allocation pops the head,
    release appends to the tail, and a cache hit on a free block removes it from the middle,
    all in O(1). Cached free blocks are also queued per pool, so that a pool above its share
    can be evicted first (prefix_cache.pools).
    """

    def __init__(self, num_blocks: int, publish_every: int = 4, log_size: int = 65536,
                 pools: PoolAccounting | None = None) -> None:
        self.num_blocks = num_blocks
        self.pools = pools or PoolAccounting(num_blocks)
        # Bookkeeping made on a block's first use: an engine sized by memory has 100k+
        # block ids, most never touched by a short run, and a list of them all was half a
        # second of every start.
        self._blocks = _Blocks(num_blocks)
        self._cached_free: dict[str, OrderedDict[int, None]] = {}
        self._block_of: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Sparse publication log for the router: every publish_every-th chain block.
        self.publish_every = publish_every
        self._log: deque[tuple[int, bool, int]] = deque(maxlen=log_size)
        self._log_seq = 0
        self.events: CacheEventSink | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def match(self, hashes: Sequence[int]) -> list[int]:
        blocks: list[int] = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            block = self._blocks[b]
            if block.ref_count == 0:
                del self._free[b]
                if block.block_hash is not None:
                    del self._cached_free[block.pool][b]
                    self.pools.cached[block.pool] -= 1
                self.pools.used[block.pool] += 1
            block.ref_count += 1

    def allocate(self, n: int, pool: str = BASE_POOL) -> list[int]:
        assert n <= len(self._free), "caller must check num_free first"
        ids = []
        for _ in range(n):
            block = self._blocks[self._take_free_block()]
            self._evict(block)
            block.ref_count = 1
            block.pool = pool
            self.pools.used[pool] += 1
            ids.append(block.block_id)
        return ids

    def _take_free_block(self) -> int:
        """The global LRU head, unless some pool's cached blocks exceed its share: then
        that pool's least recently freed cached block."""
        over = self.pools.most_over_share()
        if over is not None:
            b = next(iter(self._cached_free[over]))
            del self._free[b]
            return b
        return self._free.popitem(last=False)[0]

    def release(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            block = self._blocks[b]
            assert block.ref_count > 0, f"block {b} released more often than acquired"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None
                self.pools.used[block.pool] -= 1
                if block.block_hash is not None:
                    self.pools.cached[block.pool] += 1
                    self._cached_free.setdefault(block.pool, OrderedDict())[b] = None

    def insert(self, block_id: int, block_hash: int, block_index: int) -> bool:
        block = self._blocks[block_id]
        if block_hash in self._block_of or block.block_hash is not None:
            return False
        self._block_of[block_hash] = block_id
        block.block_hash = block_hash
        block.chain_index = block_index
        self._record(True, block_hash, block_index)
        return True

    def _evict(self, block: Block) -> None:
        """Drop the hash of a free block that is being reused."""
        h = block.block_hash
        if h is None:
            return
        del self._cached_free[block.pool][block.block_id]
        self.pools.cached[block.pool] -= 1
        self.pools.evictions[block.pool] += 1
        del self._block_of[h]
        block.block_hash = None
        self._record(False, h, block.chain_index)
        if self.events is not None:
            self.events.removed(h)

    def drop_pool(self, pool: str) -> None:
        """The adapter of ``pool`` was unloaded (no request of it is left): its cached blocks
        could only serve it, so they are evicted and reused first, and its figures go
        (PoolAccounting.forget), so /metrics shows no series of an adapter that is gone."""
        if pool == BASE_POOL:  # an adapter named "base" shares the base model's pool
            return
        for b in list(self._cached_free.get(pool, ())):
            self._evict(self._blocks[b])
            self._free.move_to_end(b, last=False)
        self._cached_free.pop(pool, None)
        self.pools.forget(pool)

    # ------------------------------------------------------------------ publication
    def _record(self, added: bool, block_hash: int, block_index: int) -> None:
        if (block_index + 1) % self.publish_every == 0:
            self._log_seq += 1
            self._log.append((self._log_seq, added, block_hash))

    def publish(self, cursor: int = 0) -> PrefixUpdate:
        """Sparse hashes added / removed since ``cursor`` (0 = everything)."""
        oldest = self._log[0][0] if self._log else self._log_seq + 1
        if cursor == 0 or cursor + 1 < oldest:
            current = [h for h, b in self._block_of.items()
                       if (self._blocks[b].chain_index + 1) % self.publish_every == 0]
            return PrefixUpdate(self._log_seq, True, current, [])
        last_state: dict[int, bool] = {}  # a hash may come and go several times
        for seq, was_added, h in self._log:
            if seq > cursor:
                last_state[h] = was_added
        return PrefixUpdate(self._log_seq, False,
                            [h for h, present in last_state.items() if present],
                            [h for h, present in last_state.items() if not present])
