"""Chained block hashes: the one function engines and gateways share.

    hash(block i) = xxh3_128(hash(block i-1), token ids of block i, extra keys)

with a fixed root, so every process on every host computes the same chain (no per-process
hash seed). Only full blocks are hashed. Extra keys are typed tuples whose first element
names the domain, and every field is length-prefixed in the digest input, so no two domains
can encode to the same bytes: an adapter named "x" and a cache salt "x" never collide.

Extra keys in use:
    ("lora", adapter_name, content_digest)   every block of a request run with an adapter
    ("salt", cache_salt)                     every block of a request with a cache salt
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import xxhash

ExtraKey = tuple[str, ...]

ROOT_HASH = 0
"""Parent of the first block: a constant, so chains agree across processes."""

_TOKEN_ARRAY = "I"  # uint32: every vocabulary we serve fits


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def encode_extra_keys(keys: Sequence[ExtraKey]) -> bytes:
    """Unambiguous bytes of a list of typed tuples."""
    parts = [struct.pack("<I", len(keys))]
    for key in keys:
        if not key or not all(isinstance(f, str) for f in key):
            raise ValueError(f"extra key must be a non-empty tuple of str, got {key!r}")
        parts.append(struct.pack("<I", len(key)))
        parts.extend(_field(f.encode("utf-8")) for f in key)
    return b"".join(parts)


def request_extra_keys(lora: tuple[str, str] | None = None, cache_salt: str | None = None
                       ) -> tuple[ExtraKey, ...]:
    """The extra keys of a request: its adapter (name, content digest) and its salt."""
    keys: list[ExtraKey] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if cache_salt is not None:
        keys.append(("salt", cache_salt))
    return tuple(keys)


def hash_block(parent: int, token_ids: Sequence[int], extra: bytes) -> int:
    """128-bit hash of one full block given its parent's hash and encoded extra keys."""
    h = xxhash.xxh3_128()
    h.update(parent.to_bytes(16, "little"))
    tokens = array(_TOKEN_ARRAY, token_ids)
    h.update(struct.pack("<I", len(tokens)))
    h.update(tokens.tobytes())
    h.update(extra)
    return h.intdigest()


def chain_hashes(token_ids: Sequence[int], block_size: int,
                 extra_keys: Sequence[ExtraKey] = (), start: int = 0,
                 parent: int = ROOT_HASH) -> list[int]:
    """Hashes of the full blocks of token_ids, from block index ``start`` on.

    ``parent`` must be the hash of block start - 1 (ROOT_HASH when start == 0), so a chain
    can be extended as a request grows without rehashing its prefix.
    """
    extra = encode_extra_keys(extra_keys)
    hashes: list[int] = []
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin:begin + block_size], extra)
        hashes.append(parent)
    return hashes


def sparse_chain(hashes: Sequence[int], every: int) -> list[tuple[int, int]]:
    """(block index, hash) of every ``every``-th block (indices every-1, 2*every-1, ...): the
    summary an engine publishes and the router matches."""
    return [(i, h) for i, h in enumerate(hashes) if (i + 1) % every == 0]
