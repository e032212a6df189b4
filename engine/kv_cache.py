"""Paged KV-cache bookkeeping: block pools, per-request block tables, CPU swap space.

Only ids live here; the tensors the ids index belong to the model runner. A request's KV
for token position p lives in block ``block_table[p // block_size]`` at offset
``p % block_size``:

    positions  [0 ........ bs-1][bs ...... 2bs-1][2bs .. n-1   ]
    blocks      block_table[0]   block_table[1]   block_table[2] (partly filled)
"""

from __future__ import annotations

from collections import deque

from engine.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens."""
    return -(-num_tokens // block_size)


class BlockPool:
    """A fixed set of block ids with a free list. Every id is either free or owned by
    exactly one table; ``num_free + num_used == num_blocks`` always holds."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # FIFO reuse spreads writes over the pool; order does not matter for correctness.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "caller must check num_free first"
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class KVCacheManager:
    """Block tables of running requests over the device pool, plus CPU swap space.

    allocate_slots() grows a request's table to cover its next tokens or returns False
    without side effects; free() returns a request's blocks at once (finish, abort,
    recompute preemption). swap_out()/swap_in() move a table between the pools and return
    the (src, dst) block pairs the runner must copy before the next forward.
    """

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0) -> None:
        self.block_size = block_size
        self.device_pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap_blocks)
        self._tables: dict[str, list[int]] = {}
        self._swapped_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.device_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.device_pool.num_free

    @property
    def usage(self) -> float:
        return self.device_pool.num_used / self.device_pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def can_ever_fit(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= self.device_pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make the request's table cover positions up to num_computed + num_new_tokens."""
        table = self._tables.setdefault(request.request_id, [])
        need = blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size)
        missing = need - len(table)
        if missing <= 0:
            return True
        if missing > self.device_pool.num_free:
            if not table:
                del self._tables[request.request_id]
            return False
        table.extend(self.device_pool.allocate(missing))
        return True

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.device_pool.free(table)
        swapped = self._swapped_tables.pop(request_id, None)
        if swapped:
            self.swap_pool.free(swapped)

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move a table to swap space; None (nothing changed) if swap space is short."""
        table = self._tables.get(request_id, [])
        if len(table) > self.swap_pool.num_free:
            return None
        cpu_blocks = self.swap_pool.allocate(len(table))
        self._swapped_tables[request_id] = cpu_blocks
        self.device_pool.free(self._tables.pop(request_id, []))
        return list(zip(table, cpu_blocks, strict=True))

    def can_swap_in(self, request_id: str) -> bool:
        return len(self._swapped_tables.get(request_id, [])) <= self.device_pool.num_free

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move a swapped table back to the device pool; caller checked can_swap_in()."""
        cpu_blocks = self._swapped_tables.pop(request_id)
        device_blocks = self.device_pool.allocate(len(cpu_blocks))
        self._tables[request_id] = device_blocks
        self.swap_pool.free(cpu_blocks)
        return list(zip(cpu_blocks, device_blocks, strict=True))
