"""KVCacheManager: block ids handed out, given back and moved between device and swap pools."""

from __future__ import annotations

import pytest

from engine.kv_cache import BlockPool, KVCacheManager, blocks_for
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(request_id: str, prompt_len: int, num_computed_tokens: int = 0) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(prompt_len)),
        sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
        eos_token_ids=frozenset(),
        arrival_seq=0,
        num_computed_tokens=num_computed_tokens,
    )


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.swap_pool.num_free == kv.swap_pool.num_blocks


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (17, 16, 2)],
)
def test_blocks_for(num_tokens: int, block_size: int, expected: int) -> None:
    assert blocks_for(num_tokens, block_size) == expected


def test_swap_block_pool_hands_out_ids_in_order_and_reuses_freed_ids_fifo() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.num_free == 2
    pool.free([1, 0])
    assert pool.allocate(3) == [2, 3, 1]
    assert pool.num_free == 1


def test_capacity_is_the_whole_cache_in_whole_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.max_tokens_per_request() == 16


def test_allocate_slots_grows_table_with_fresh_ids_in_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", prompt_len=20)

    assert kv.allocate_slots(req, 5)  # positions 0..4 -> 2 blocks
    assert kv.block_table("a") == [0, 1]
    req.num_computed_tokens = 5

    assert kv.allocate_slots(req, 3)  # positions 5..7 still inside block 1
    assert kv.block_table("a") == [0, 1]
    req.num_computed_tokens = 8

    assert kv.allocate_slots(req, 9)  # positions 8..16 -> blocks 2, 3, 4
    assert kv.block_table("a") == [0, 1, 2, 3, 4]
    assert kv.num_free_blocks == 3


def test_allocate_slots_tables_of_two_requests_do_not_share_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a", 8), make_request("b", 8)
    assert kv.allocate_slots(a, 4)
    assert kv.allocate_slots(b, 8)
    a.num_computed_tokens = 4
    assert kv.allocate_slots(a, 4)
    assert kv.block_table("a") == [0, 3]
    assert kv.block_table("b") == [1, 2]


def test_allocate_slots_failure_has_no_side_effects() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", 12)
    assert kv.allocate_slots(a, 12)  # blocks 0, 1, 2
    a.num_computed_tokens = 12

    assert not kv.allocate_slots(a, 8)  # needs 2 more, only 1 free
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.num_free_blocks == 1

    b = make_request("b", 8)
    assert not kv.allocate_slots(b, 8)  # a fresh request gets no (empty) table either
    assert kv.block_table("b") == []
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 4)
    assert kv.block_table("b") == [3]


def test_free_returns_every_block_and_is_idempotent() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a", 8), make_request("b", 4)
    assert kv.allocate_slots(a, 8)
    assert kv.allocate_slots(b, 4)
    kv.free("a")
    assert kv.block_table("a") == []
    assert kv.num_free_blocks == 3
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_blocks == 3
    c = make_request("c", 12)
    assert kv.allocate_slots(c, 12)
    # Freed blocks join the free queue's tail, last block first; allocation takes the head.
    assert kv.block_table("c") == [3, 1, 0]
    kv.free("b")
    kv.free("c")
    assert_all_free(kv)


def test_swap_out_and_in_return_exact_block_pairs() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, num_swap_blocks=4)
    a, b = make_request("a", 8), make_request("b", 12)
    assert kv.allocate_slots(a, 8)  # a: [0, 1]
    assert kv.allocate_slots(b, 12)  # b: [2, 3, 4]

    assert kv.swap_out("b", 12) == [(2, 0), (3, 1), (4, 2)]  # (device, cpu)
    assert kv.block_table("b") == []
    assert kv.num_free_blocks == 4  # free queue: 5, then b's blocks last first: 4, 3, 2
    assert kv.swap_pool.num_free == 1

    assert kv.allocate_slots(make_request("c", 4), 4)
    assert kv.block_table("c") == [5]

    assert kv.swap_in(b) == [(0, 4), (1, 3), (2, 2)]  # (cpu, device)
    assert kv.block_table("b") == [4, 3, 2]
    assert kv.swap_pool.num_free == 4
    assert kv.num_free_blocks == 0

    for request_id in ("a", "b", "c"):
        kv.free(request_id)
    assert_all_free(kv)


def test_swap_out_without_room_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, num_swap_blocks=2)
    a = make_request("a", 12)
    assert kv.allocate_slots(a, 12)
    assert kv.swap_out("a", 12) is None
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.num_free_blocks == 1
    assert kv.swap_pool.num_free == 2
    kv.free("a")
    assert_all_free(kv)


def test_free_releases_swap_blocks_of_a_swapped_request() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, num_swap_blocks=4)
    a = make_request("a", 8)
    assert kv.allocate_slots(a, 8)
    assert kv.swap_out("a", 8) == [(0, 0), (1, 1)]
    kv.free("a")
    assert_all_free(kv)


def test_swap_out_keeps_only_computed_blocks() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, num_swap_blocks=4)
    a = make_request("a", 16)
    assert kv.allocate_slots(a, 16)  # [0, 1, 2, 3], but only 6 tokens computed so far
    assert kv.swap_out("a", 6) == [(0, 0), (1, 1)]
    assert kv.num_free_blocks == 6 and kv.swap_pool.num_free == 2
    kv.free("a")
    assert_all_free(kv)
