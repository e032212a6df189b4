"""prompt_cache_key: requests that say they share a cacheable prefix go where the last of
them went.

OpenAI's field tells its router which requests share a long prefix, so that they reach the
machine that has it cached even before any prefix of theirs is known there (the first
blocks of a conversation, a prompt under one block, an index that missed an event). Here the
instance the key's previous request was routed to is credited as if it held the whole prompt
cached (gateway/router.py): the prefix term's full weight, yielding under imbalance like
any prefix credit, so one busy key spreads instead of queueing on one instance.

A key counts only among requests that could share cache blocks at all: the same cache salt
(a tenant's own, and the request's cache_salt) and the same adapter. The table is bounded:
the least recently routed keys are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_KEYS = 65536
"""Keys remembered at once (about 10 MB at most with their salts)."""

AffinityKey = tuple[str, str, str]
"""(cache salt or "", adapter or "", prompt_cache_key)."""


def affinity_key(cache_salt: str | None, adapter: str | None, prompt_cache_key: str | None
                 ) -> AffinityKey | None:
    """The table's key for a request (None: it sent no prompt_cache_key)."""
    if prompt_cache_key is None:
        return None
    return (cache_salt or "", adapter or "", prompt_cache_key)


class CacheKeyAffinity:
    """prompt_cache_key -> the instance its last request was routed to."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._last: OrderedDict[AffinityKey, str] = OrderedDict()

    def instance_for(self, key: AffinityKey | None) -> str | None:
        return None if key is None else self._last.get(key)

    def note(self, key: AffinityKey | None, instance_id: str) -> None:
        """Record where a request with this key was routed."""
        if key is None:
            return
        self._last[key] = instance_id
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)
