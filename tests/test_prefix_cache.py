"""Prefix cache: hashing, block cache eviction order, isolation, admission, auto switch,
router index."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestTiming
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from prefix_cache.adaptive import AdaptiveConfig, HitRateTracker
from prefix_cache.cache import HashBlockCache
from prefix_cache.hashing import ExtraKey, chain_hashes, request_extra_keys, sparse_chain
from prefix_cache.index import PrefixIndex

BS = 4


def make_request(request_id: str, tokens: list[int], seq: int = 0, max_tokens: int = 4,
                 extra_keys: tuple[ExtraKey, ...] = ()) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_ids=frozenset(), arrival_seq=seq, extra_keys=extra_keys,
                   timing=RequestTiming(arrival=time.monotonic()))


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert all(kv.pool.ref_count(b) == 0 for b in range(kv.num_blocks))


# ------------------------------------------------------------------------------ hashing
def test_chain_is_the_same_in_another_process() -> None:
    tokens = list(range(100, 140))
    here = chain_hashes(tokens, 16, request_extra_keys(("ad", "d1"), "s"))
    code = ("from prefix_cache.hashing import chain_hashes, request_extra_keys;"
            "print(chain_hashes(list(range(100, 140)), 16, "
            "request_extra_keys(('ad', 'd1'), 's')))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, check=True).stdout.strip()
    assert there == str(here)
    assert len(here) == 2  # only the two full blocks of 40 tokens


def test_chain_hashes_extend_incrementally() -> None:
    tokens = list(range(64))
    whole = chain_hashes(tokens, BS)
    first = chain_hashes(tokens[:20], BS)
    rest = chain_hashes(tokens, BS, start=len(first), parent=first[-1])
    assert first + rest == whole


def test_extra_key_domains_never_collide() -> None:
    tokens = [7] * 8
    adapter_named_x = chain_hashes(tokens, BS, request_extra_keys(("x", "digest"), None))
    salt_x = chain_hashes(tokens, BS, request_extra_keys(None, "x"))
    both = chain_hashes(tokens, BS, request_extra_keys(("x", "digest"), "x"))
    plain = chain_hashes(tokens, BS)
    assert len({adapter_named_x[0], salt_x[0], both[0], plain[0]}) == 4
    # Field boundaries are part of the hash: ("ab", "c") != ("a", "bc").
    assert chain_hashes(tokens, BS, [("lora", "ab", "c")]) != chain_hashes(
        tokens, BS, [("lora", "a", "bc")])
    # An adapter whose name equals a salt string and whose digest is empty.
    assert chain_hashes(tokens, BS, [("lora", "x", "")]) != chain_hashes(tokens, BS,
                                                                       [("salt", "x")])


def test_sparse_chain_picks_every_nth_block() -> None:
    hashes = chain_hashes(list(range(40)), BS)
    assert [i for i, _ in sparse_chain(hashes, 4)] == [3, 7]


# -------------------------------------------------------------------------- block cache
def test_eviction_order_is_lru_with_suffix_first() -> None:
    cache = HashBlockCache(6)
    a = cache.allocate(3)  # request A: blocks [0, 1, 2]
    b = cache.allocate(2)  # request B: blocks [3, 4]
    assert (a, b) == ([0, 1, 2], [3, 4])
    for i, block in enumerate(a):
        assert cache.insert(block, 100 + i, i)
    for i, block in enumerate(b):
        assert cache.insert(block, 200 + i, i)
    cache.release(a[::-1])  # A ends first: suffix 2 queued before its prefix 0
    cache.release(b[::-1])
    assert cache.num_free == 6 and cache.num_cached == 5
    # Free queue now: 5 (never used), 2, 1, 0, 4, 3. Allocation takes from the head.
    assert cache.allocate(2) == [5, 2]
    assert cache.pools.evictions.total() == 1 and cache.match([100, 101, 102]) == [0, 1]
    assert cache.allocate(3) == [1, 0, 4]
    assert cache.match([100]) == [] and cache.match([200]) == [3]
    assert cache.pools.evictions.total() == 4


def test_hit_on_free_block_removes_it_from_the_middle_of_the_queue() -> None:
    cache = HashBlockCache(4)
    blocks = cache.allocate(3)
    for i, block in enumerate(blocks):
        cache.insert(block, 10 + i, i)
    cache.release(blocks[::-1])  # queue: 3, 2, 1, 0
    hit = cache.match([10, 11])
    assert hit == [0, 1]
    cache.acquire(hit)
    assert cache.num_free == 2
    assert cache.allocate(2) == [3, 2]  # the hit blocks were skipped
    assert cache.ref_count(0) == cache.ref_count(1) == 1


def test_duplicate_insert_keeps_the_first_block() -> None:
    cache = HashBlockCache(4)
    first, second = cache.allocate(2)
    assert cache.insert(first, 42, 0)
    assert not cache.insert(second, 42, 0)
    assert cache.match([42]) == [first]


def test_release_more_than_acquired_is_an_invariant_violation() -> None:
    cache = HashBlockCache(2)
    block = cache.allocate(1)
    cache.release(block)
    with pytest.raises(AssertionError, match="released more often than acquired"):
        cache.release(block)


# ------------------------------------------------------------------ KV manager + sched
def _kv(num_blocks: int = 16, mode: str = "on") -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, prefix_caching=mode)  # type: ignore[arg-type]


def _compute(kv: KVCacheManager, request: Request) -> None:
    """Admit and fully compute a request's prompt, as the scheduler would."""
    hit = kv.find_cached_prefix(request)
    start = len(hit) * BS
    assert kv.allocate_slots(request, request.num_tokens - start, hit)
    request.num_computed_tokens = start
    kv.note_admitted(request, start)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)


def test_hit_is_capped_to_leave_one_token() -> None:
    kv = _kv()
    a = make_request("a", list(range(12)))
    _compute(kv, a)
    # Same 12 tokens: 3 full blocks cached, but the hit stops at 2 blocks (8 tokens).
    assert len(kv.find_cached_prefix(make_request("b", list(range(12))))) == 2
    assert len(kv.find_cached_prefix(make_request("c", list(range(13))))) == 3
    assert len(kv.find_cached_prefix(make_request("d", [*range(6), 99, 98]))) == 1
    kv.free("a")
    assert_all_free(kv)
    assert kv.pool.num_cached == 3


@pytest.mark.parametrize(("keys_a", "keys_b", "shared"), [
    ((), (), True),
    (request_extra_keys(None, "tenant-1"), request_extra_keys(None, "tenant-1"), True),
    (request_extra_keys(None, "tenant-1"), request_extra_keys(None, "tenant-2"), False),
    ((), request_extra_keys(None, "tenant-1"), False),
    (request_extra_keys(("ad", "v1"), None), request_extra_keys(("ad", "v1"), None), True),
    (request_extra_keys(("ad", "v1"), None), request_extra_keys(("ad", "v2"), None), False),
    (request_extra_keys(("ad", "v1"), None), request_extra_keys(("other", "v1"), None), False),
    (request_extra_keys(("ad", "v1"), None), (), False),
    (request_extra_keys(("x", ""), None), request_extra_keys(None, "x"), False),
])
def test_isolation_by_adapter_and_salt(keys_a: tuple[ExtraKey, ...],
                                       keys_b: tuple[ExtraKey, ...], shared: bool) -> None:
    kv = _kv()
    tokens = list(range(20))
    a = make_request("a", tokens, extra_keys=keys_a)
    _compute(kv, a)
    b = make_request("b", tokens, extra_keys=keys_b)
    hit = kv.find_cached_prefix(b)
    assert (len(hit) == 4) is shared and (len(hit) == 0) is (not shared)
    _compute(kv, b)
    overlap = set(kv.block_table("a")) & set(kv.block_table("b"))
    assert bool(overlap) is shared
    kv.free("a")
    kv.free("b")
    assert_all_free(kv)


def _scheduler(num_blocks: int = 32, **overrides: object) -> Scheduler:
    config = EngineConfig(model="unused", block_size=BS, max_num_batched_tokens=16,
                          **overrides)  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(num_blocks, BS, prefix_caching="on"))


def _step(sched: Scheduler) -> list[tuple[str, int, int]]:
    out = sched.schedule()
    sched.update(out, {c.request_id: 1 for c in out.chunks if c.sample})
    return [(c.request_id, c.start_pos, c.num_tokens) for c in out.chunks]


def test_shared_prefix_in_flight_is_computed_once() -> None:
    sched = _scheduler()
    doc = list(range(40))
    sched.add(make_request("first", doc + [1000], seq=0, max_tokens=1))
    sched.add(make_request("second", doc + [2000], seq=1, max_tokens=1))
    # Budget 16: first computes the document chunk by chunk; second is held (its next block
    # is in flight) instead of computing the same blocks alongside.
    assert _step(sched) == [("first", 0, 16)]
    assert _step(sched) == [("first", 16, 16)]
    assert _step(sched) == [("first", 32, 9)]
    # The document's 10 full blocks are cached now: second computes only its last block.
    assert _step(sched) == [("second", 40, 1)]
    assert not sched.has_unfinished()
    assert sched.kv.pools.stats()["base"].hit_tokens == 40
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_chunks_after_a_hit_stay_block_aligned() -> None:
    sched = _scheduler()
    sched.add(make_request("warm", list(range(10)), seq=0, max_tokens=1))
    while sched.has_unfinished():
        _step(sched)
    sched.add(make_request("long", list(range(10)) + list(range(500, 530)), seq=1,
                           max_tokens=1))
    # 2 blocks (8 tokens) hit; chunks then end on multiples of 4 within the 16 budget.
    assert _step(sched) == [("long", 8, 16)]
    assert _step(sched) == [("long", 24, 16)]
    assert not sched.has_unfinished()


def test_cache_aware_admission_prefers_cached_prefix() -> None:
    sched = _scheduler(max_num_seqs=1)
    sched.add(make_request("warm", list(range(16)), seq=0, max_tokens=1))
    while sched.has_unfinished():
        _step(sched)
    sched.add(make_request("cold", list(range(900, 912)), seq=1, max_tokens=1))
    sched.add(make_request("hot", list(range(16)) + [77], seq=2, max_tokens=1))
    assert _step(sched) == [("hot", 16, 1)]
    assert _step(sched) == [("cold", 0, 12)]


def test_overdue_request_is_admitted_first() -> None:
    sched = _scheduler(max_num_seqs=1, max_admission_delay_s=0.0)
    sched.add(make_request("warm", list(range(16)), seq=0, max_tokens=1))
    while sched.has_unfinished():
        _step(sched)
    sched.add(make_request("cold", list(range(900, 912)), seq=1, max_tokens=1))
    sched.add(make_request("hot", list(range(16)) + [77], seq=2, max_tokens=1))
    assert _step(sched) == [("cold", 0, 12)]


# ------------------------------------------------------------------------- auto switch
def test_auto_switch_turns_off_on_low_hit_rate_and_probes_again() -> None:
    tracker = HitRateTracker("auto", AdaptiveConfig(threshold=0.3, window=4,
                                                    long_prompt_tokens=100, probe_every=3))
    for _ in range(3):
        tracker.record(200, 20)
    tracker.record(50, 0)  # short prompts do not count
    assert tracker.enabled
    tracker.record(200, 20)  # window full at 10% < 30%
    assert not tracker.enabled and tracker.num_switches == 1
    tracker.on_admitted()
    tracker.on_admitted()
    assert not tracker.enabled
    tracker.on_admitted()  # probe
    assert tracker.enabled and tracker.num_switches == 2
    for _ in range(4):
        tracker.record(200, 150)
    assert tracker.enabled and tracker.rolling_hit_rate == 0.75


def test_on_and_off_never_switch() -> None:
    on = HitRateTracker("on", AdaptiveConfig(window=1, long_prompt_tokens=1))
    on.record(100, 0)
    assert on.enabled
    off = HitRateTracker("off")
    for _ in range(1000):
        off.on_admitted()
    assert not off.enabled


def test_auto_off_stops_lookups_and_inserts() -> None:
    kv = KVCacheManager(16, BS, prefix_caching="auto",
                        adaptive=AdaptiveConfig(window=1, long_prompt_tokens=8,
                                                probe_every=100))
    # a's lookup (0% hit on a long prompt) fills the window: caching is off from then on,
    # so not even a's own blocks are inserted.
    _compute(kv, make_request("a", list(range(12))))
    assert not kv.caching_enabled
    b = make_request("b", list(range(12)))
    assert kv.find_cached_prefix(b) == []
    _compute(kv, b)
    kv.free("a")
    kv.free("b")
    assert kv.pool.num_cached == 0


# ----------------------------------------------------------------------- router index
def test_index_longest_match_and_eviction() -> None:
    engines = {name: HashBlockCache(32, publish_every=2) for name in ("e0", "e1", "e2")}
    index = PrefixIndex(block_size=BS, publish_every=2)
    doc = list(range(300, 340))  # 10 blocks
    chain = chain_hashes(doc, BS)

    def hold(name: str, num_blocks: int) -> list[int]:
        blocks = engines[name].allocate(num_blocks)
        for i, (block, h) in enumerate(zip(blocks, chain, strict=False)):
            engines[name].insert(block, h, i)
        return blocks

    held = hold("e0", 4)
    hold("e1", 9)
    for name, cache in engines.items():
        index.apply(name, cache.publish(index.cursor(name)))
    request = index.request_chain(doc + [1, 2, 3])
    assert index.match(request) == {"e0": 16, "e1": 32, "e2": 0}
    assert index.longest_match(request) == ("e1", 32)
    assert index.longest_match(index.request_chain(list(range(900, 940)))) == (None, 0)

    # e1 evicts everything (its blocks are reused); e0 keeps its prefix.
    engines["e1"].release(engines["e1"].match(chain)[::-1])
    engines["e1"].allocate(32)
    engines["e0"].release(held[::-1])
    for name, cache in engines.items():
        index.apply(name, cache.publish(index.cursor(name)))
    assert index.longest_match(request) == ("e0", 16)


def test_publish_cursor_replays_only_new_events() -> None:
    cache = HashBlockCache(8, publish_every=1)
    blocks = cache.allocate(2)
    cache.insert(blocks[0], 11, 0)
    first = cache.publish(0)
    assert first.full and first.added == [11]
    cache.insert(blocks[1], 12, 1)
    second = cache.publish(first.cursor)
    assert not second.full and second.added == [12] and second.removed == []
    cache.release(blocks[::-1])
    cache.allocate(8)  # evicts both
    third = cache.publish(second.cursor)
    assert sorted(third.removed) == [11, 12] and third.added == []
