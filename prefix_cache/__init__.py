"""Prefix cache: block hashes aligned to the KV block size, the cache of blocks by hash with
per-adapter pools, and the gateway-side index of what each engine holds.

The bottom of the package chain prefix_cache -> lora -> engine -> gateway: it imports none
of the others (tests/test_import_graph.py)."""

from prefix_cache.adaptive import AdaptiveConfig
from prefix_cache.hashing import chain_hashes, hash_block, request_extra_keys
from prefix_cache.index import PrefixIndex
from prefix_cache.pools import PoolAccounting, PoolStats

__all__ = ["AdaptiveConfig", "PoolAccounting", "PoolStats", "PrefixIndex", "chain_hashes",
           "hash_block", "request_extra_keys"]
