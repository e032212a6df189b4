"""prompt_cache_key's table: scoped to requests that can share cache blocks, bounded, least
recently routed forgotten first."""

from __future__ import annotations

from gateway.cache_key_affinity import CacheKeyAffinity, affinity_key


def test_a_key_counts_only_with_the_same_salt_and_adapter() -> None:
    table = CacheKeyAffinity()
    table.note(affinity_key("salt-a", None, "conv-1"), "engine-1")
    assert table.instance_for(affinity_key("salt-a", None, "conv-1")) == "engine-1"
    for other in (affinity_key("salt-b", None, "conv-1"),  # another tenant's
                  affinity_key("salt-a", "bot", "conv-1"),  # another adapter's KV
                  affinity_key("salt-a", None, "conv-2")):
        assert table.instance_for(other) is None
    assert affinity_key("salt-a", None, None) is None  # no key sent: nothing recorded
    table.note(None, "engine-2")
    assert len(table) == 1


def test_the_least_recently_routed_keys_are_forgotten_first() -> None:
    table = CacheKeyAffinity(max_keys=2)
    keys = [affinity_key(None, None, f"k{i}") for i in range(3)]
    table.note(keys[0], "a")
    table.note(keys[1], "b")
    table.note(keys[0], "c")  # routed again: now the most recent, and moved
    table.note(keys[2], "d")
    assert [table.instance_for(k) for k in keys] == ["c", None, "d"]
