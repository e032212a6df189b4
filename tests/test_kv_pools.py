"""Per-adapter KV pools: floors, caps, preemption inside a capped pool, eviction by share."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from prefix_cache.cache import HashBlockCache
from prefix_cache.pools import PoolAccounting

BS = 4


def make_request(request_id: str, n: int, lora: str | None = None, seq: int = 0,
                 max_tokens: int = 8, first_token: int = 0) -> Request:
    return Request(request_id=request_id,
                   prompt_token_ids=list(range(first_token, first_token + n)),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_ids=frozenset(), arrival_seq=seq, lora_name=lora)


def test_floor_reserves_blocks_for_its_pool() -> None:
    kv = KVCacheManager(8, BS, pool_shares=(("ad", 0.5, 1.0),))
    base = make_request("base", 40)
    assert not kv.allocate_slots(base, 20)  # 5 blocks > 8 - 4 reserved for "ad"
    assert kv.allocate_slots(base, 16)  # 4 blocks
    ad = make_request("a", 16, lora="ad")
    assert kv.allocate_slots(ad, 16)  # the floor is still there for "ad"
    assert kv.pools.used == {"base": 4, "ad": 4}
    assert kv.max_tokens_per_request() < 20 <= kv.max_tokens_per_request("ad")


def test_cap_bounds_a_pool() -> None:
    kv = KVCacheManager(8, BS, pool_shares=(("ad", 0.0, 0.25),))
    a = make_request("a", 8, lora="ad")
    assert kv.allocate_slots(a, 8)  # 2 blocks = the cap
    b = make_request("b", 4, lora="ad")
    assert kv.pool_at_cap(b, 4) and not kv.allocate_slots(b, 4)
    assert kv.allocate_slots(make_request("base", 16), 16)  # others are not capped
    assert kv.max_tokens_per_request("ad") < 12


def test_over_share_pool_is_evicted_first() -> None:
    pools = PoolAccounting(8)
    cache = HashBlockCache(8, pools=pools)
    hog = cache.allocate(6, "hog")
    for i, b in enumerate(hog):
        cache.insert(b, 1000 + i, i)
    mine = cache.allocate(2, "base")
    for i, b in enumerate(mine):
        cache.insert(b, 2000 + i, i)
    cache.release(mine[::-1])  # base's cached blocks are the LRU head...
    cache.release(hog[::-1])
    assert pools.cached == {"hog": 6, "base": 2}
    # ...but "hog" holds 6 of 8 blocks, over its fair half: its blocks go first.
    taken = cache.allocate(2, "base")
    assert set(taken) <= set(hog)
    assert cache.match([2000, 2001]) == mine
    assert pools.evictions == {"hog": 2}


def test_pool_stats_in_engine_config_and_errors() -> None:
    with pytest.raises(ValueError, match="needs 0 <= floor <= cap <= 1"):
        EngineConfig(model="m", kv_pool_shares=(("ad", 0.6, 0.5),))
    with pytest.raises(ValueError, match="floors add up to more than the whole cache"):
        EngineConfig(model="m", kv_pool_shares=(("a", 0.6, 1.0), ("b", 0.6, 1.0)))
    kv = KVCacheManager(8, BS, prefix_caching="on", pool_shares=(("ad", 0.25, 0.5),))
    a = make_request("a", 9, lora="ad")
    assert kv.allocate_slots(a, 9)
    kv.note_admitted(a, 0)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    kv.free("a")
    stats = kv.pools.stats()["ad"]
    assert (stats.used_blocks, stats.cached_blocks, stats.floor_blocks, stats.cap_blocks) == (
        0, 2, 2, 4)
    assert stats.query_tokens == 9 and stats.hit_rate == 0.0


def test_an_unloaded_adapters_pool_goes_and_the_global_counts_stay() -> None:
    """drop_pool (the engine's remove_lora): the pool's cached blocks are evicted, its
    figures leave stats() (its /metrics series), its counts stay in the global sums;
    base and configured pools keep their entries."""
    kv = KVCacheManager(8, BS, prefix_caching="on", pool_shares=(("kept", 0.0, 0.5),))
    for request_id, lora, first in (("a", "gone", 0), ("k", "kept", 100)):
        request = make_request(request_id, 9, lora=lora, first_token=first)
        assert kv.allocate_slots(request, 9)
        kv.note_admitted(request, 0)
        request.num_computed_tokens = 9
        kv.cache_full_blocks(request)
        kv.free(request_id)
    assert kv.pools.stats()["gone"].cached_blocks == 2
    before = (kv.pools.stats()["gone"].query_tokens, kv.pool.num_cached)
    kv.pool.drop_pool("gone")
    kv.pool.drop_pool("kept")
    kv.pool.drop_pool("base")
    stats = kv.pools.stats()
    assert set(stats) == {"kept"}  # configured: its limits stay (its cached blocks do not)
    assert (stats["kept"].cached_blocks, kv.pool.num_cached) == (0, 0)
    assert before == (9, 4)
    retired = kv.pools.retired_stats()
    assert (retired.query_tokens, retired.evictions) == (9, 2)
    assert kv.pool.num_free == 8
