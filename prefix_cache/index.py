"""Router-side prefix index: which engine holds the longest prefix of a request.

Engines publish sparse chain hashes (every Nth block, see HashBlockCache.publish); the
gateway hashes a request's prompt with the same function (prefix_cache.hashing) and looks
for the deepest sparse hash each engine holds. A chain hash covers its whole prefix, so the
deepest hit is the match length; eviction goes suffix-first, so a deeper hit without the
shallower ones is rare and still a true match of the blocks it names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prefix_cache.cache import PrefixUpdate
from prefix_cache.hashing import ExtraKey, chain_hashes, sparse_chain


@dataclass
class _EngineEntry:
    hashes: set[int] = field(default_factory=set)
    cursor: int = 0


class PrefixIndex:
    """Per-engine sets of published sparse hashes, kept current by apply()."""

    def __init__(self, block_size: int, publish_every: int) -> None:
        self.block_size = block_size
        self.publish_every = publish_every
        self._engines: dict[str, _EngineEntry] = {}

    def cursor(self, engine_id: str) -> int:
        """The cursor to ask engine_id's publish() with next."""
        entry = self._engines.get(engine_id)
        return entry.cursor if entry else 0

    def apply(self, engine_id: str, update: PrefixUpdate) -> None:
        entry = self._engines.setdefault(engine_id, _EngineEntry())
        if update.full:
            entry.hashes = set(update.added)
        else:
            entry.hashes.update(update.added)
            entry.hashes.difference_update(update.removed)
        entry.cursor = update.cursor

    def size(self, engine_id: str) -> int:
        """Sparse hashes engine_id has published and not withdrawn."""
        entry = self._engines.get(engine_id)
        return len(entry.hashes) if entry else 0

    def remove_engine(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)

    def request_chain(self, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
                      ) -> list[tuple[int, int]]:
        """The (block index, hash) pairs of a prompt that engines may have published."""
        return sparse_chain(chain_hashes(token_ids, self.block_size, extra_keys),
                            self.publish_every)

    def match(self, chain: Sequence[tuple[int, int]], engine_ids: Iterable[str] | None = None
              ) -> dict[str, int]:
        """Matched prefix length in tokens per engine (0 when nothing matches)."""
        ids = list(self._engines) if engine_ids is None else list(engine_ids)
        result: dict[str, int] = {}
        for engine_id in ids:
            entry = self._engines.get(engine_id)
            matched = 0
            if entry is not None:
                for index, h in reversed(chain):
                    if h in entry.hashes:
                        matched = (index + 1) * self.block_size
                        break
            result[engine_id] = matched
        return result

    def longest_match(self, chain: Sequence[tuple[int, int]],
                      engine_ids: Iterable[str] | None = None) -> tuple[str | None, int]:
        """The engine with the longest match (None when no engine matches anything)."""
        matches = self.match(chain, engine_ids)
        best = max(matches.items(), key=lambda kv: kv[1], default=(None, 0))
        return (best[0], best[1]) if best[1] > 0 else (None, 0)
