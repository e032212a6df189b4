"""The router's prefix index counts what it routed until the engine's publish says otherwise."""

from __future__ import annotations

from prefix_cache.cache import HashBlockCache
from prefix_cache.hashing import chain_hashes
from prefix_cache.index import PrefixIndex

BS = 4


class FakeClock:
    """Seconds that only move when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _index(clock: FakeClock) -> PrefixIndex:
    return PrefixIndex(block_size=BS, publish_every=2, routed_ttl_s=10.0, clock=clock)


def test_a_routed_chain_matches_before_any_publish_and_expires() -> None:
    clock = FakeClock()
    index = _index(clock)
    doc = list(range(300, 340))  # 10 blocks; sparse hashes of blocks 1, 3, 5, 7, 9
    index.note_routed("e0", index.request_chain(doc))
    request = index.request_chain([*doc, 1, 2])
    assert index.match(request, ["e0", "e1"]) == {"e0": 40, "e1": 0}
    # A shorter shared prefix matches as far as the routed chain goes.
    assert index.match(index.request_chain(doc[:24] + [7] * 8), ["e0"]) == {"e0": 24}
    clock.now += 9.9
    assert index.longest_match(request) == ("e0", 40)
    clock.now += 0.2
    assert index.longest_match(request) == (None, 0)
    assert index.size("e0") == 0


def test_noting_again_refreshes_and_publish_replaces_the_guess() -> None:
    clock = FakeClock()
    index = _index(clock)
    engine = HashBlockCache(16, publish_every=2)
    doc = list(range(500, 532))  # 8 blocks
    chain = chain_hashes(doc, BS)
    index.note_routed("e0", index.request_chain(doc))
    clock.now += 8
    index.note_routed("e0", index.request_chain(doc))  # a second request, same document
    clock.now += 8  # 16 s after the first note, 8 after the second
    assert index.match(index.request_chain(doc), ["e0"]) == {"e0": 32}

    # The engine computed only the first 4 blocks, then published: they are held for good,
    # and what it withdraws is gone at once even though it was routed there recently.
    blocks = engine.allocate(4)
    for i, block in enumerate(blocks):
        engine.insert(block, chain[i], i)
    index.apply("e0", engine.publish(index.cursor("e0")))
    clock.now += 30  # every routed note is stale now
    assert index.match(index.request_chain(doc), ["e0"]) == {"e0": 16}
    index.note_routed("e0", index.request_chain(doc))
    engine.release(blocks[::-1])
    engine.allocate(16)  # evicts the 4 cached blocks
    index.apply("e0", engine.publish(index.cursor("e0")))
    # Published-then-withdrawn blocks 1 and 3 are gone; the routed guess for 5 and 7 stays.
    assert index.size("e0") == 0
    assert index.match(index.request_chain(doc), ["e0"]) == {"e0": 32}


def test_removing_an_engine_drops_its_routed_notes() -> None:
    clock = FakeClock()
    index = _index(clock)
    doc = list(range(40))
    index.note_routed("e0", index.request_chain(doc))
    index.remove_engine("e0")
    assert index.longest_match(index.request_chain(doc)) == (None, 0)


def test_a_zero_ttl_trusts_only_publishes() -> None:
    index = PrefixIndex(block_size=BS, publish_every=2, routed_ttl_s=0.0, clock=FakeClock())
    doc = list(range(40))
    index.note_routed("e0", index.request_chain(doc))
    assert index.longest_match(index.request_chain(doc)) == (None, 0)
