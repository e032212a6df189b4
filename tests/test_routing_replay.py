"""The routing replay: hit rates of placements over idealized LRU prefix caches."""

from __future__ import annotations

import pytest

from benchmarks.routing_replay import replay
from benchmarks.serving_client import ServingRequest

ADAPTERS = ["a", "b"]


def _requests() -> list[ServingRequest]:
    """a, a, b, b: each pair repeats a 48-token prompt (3 blocks; 2 can hit, the cap keeps
    the last token to compute)."""
    prompt_a, prompt_b = tuple(range(10, 58)), tuple(range(100, 148))
    return [ServingRequest(prompt_a, 4, "a"), ServingRequest(prompt_a, 4, "a"),
            ServingRequest(prompt_b, 4, "b"), ServingRequest(prompt_b, 4, "b")]


@pytest.mark.parametrize(("placement", "kv_blocks", "expected"), [
    ("one cache", None, 64 / 192),
    ("by adapter", None, 64 / 192),
    ("round_robin", None, 0.0),       # each repeat lands on the other instance
    ("by adapter", 3, 64 / 192),      # a prompt's 3 blocks fit
    ("by adapter", 2, 0.0),           # the first block is evicted before the repeat
    ("one cache", 2, 64 / 192),       # one cache holds both instances' blocks (4)
])
def test_placements(placement: str, kv_blocks: int | None, expected: float) -> None:
    assert replay(_requests(), ADAPTERS, 2, placement, kv_blocks) == pytest.approx(expected)


def test_adapters_never_share_blocks() -> None:
    same_prompt = tuple(range(10, 58))
    requests = [ServingRequest(same_prompt, 4, "a"), ServingRequest(same_prompt, 4, "b")]
    assert replay(requests, ADAPTERS, 1, "one cache", None) == 0.0


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="placement must be one of"):
        replay(_requests(), ADAPTERS, 2, "random", None)
