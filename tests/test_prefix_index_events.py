"""The router's prefix index fed by KV events: 64-bit block hashes in, matches of full
request chains out, routed guesses replaced by the engine's word, and both of vLLM's event
shapes decoded."""

from __future__ import annotations

import msgspec

from engine.kv_events import BlockRemoved, BlockStoredMap, KVEventBatch
from gateway.kv_events_subscriber import decode_batch, reachable
from prefix_cache.index import EXTERNAL_MASK, PrefixIndex


def test_events_replace_polls_and_match_whole_chains() -> None:
    index = PrefixIndex(block_size=4, publish_every=1, routed_ttl_s=60.0)
    chain = index.request_chain(list(range(20)))  # 5 full blocks
    index.note_routed("e", chain[:2])
    index.apply_events("e", [h & EXTERNAL_MASK for _, h in chain[:3]], [])
    assert index.follows_events("e") and index.size("e") == 3
    assert index.match(chain)["e"] == 12
    index.apply_events("e", [], [chain[2][1] & EXTERNAL_MASK])  # evicted: suffix first
    assert index.match(chain)["e"] == 8
    index.apply_events("e", [], [], cleared=True)
    assert index.match(chain)["e"] == 0  # the routed guesses were replaced, not kept


def test_both_event_shapes_decode() -> None:
    array = msgspec.msgpack.encode(KVEventBatch(1.0, [BlockRemoved([7, 8], "GPU")], 0))
    assert decode_batch(array) == [([], [7, 8], False)]
    mapped = msgspec.msgpack.encode(KVEventBatch(1.0, [BlockStoredMap(
        [1, 2], None, list(range(8)), 4, None, "GPU", "adapter")], 0))
    assert decode_batch(mapped) == [([1, 2], [], False)]


def test_a_wildcard_endpoint_is_the_engine_host() -> None:
    assert reachable("tcp://*:5557", "http://10.0.0.7:8100") == "tcp://10.0.0.7:5557"
    assert reachable("tcp://*:5557", None) == "tcp://127.0.0.1:5557"
    assert reachable("tcp://router:1", "http://x:1") == "tcp://router:1"
