"""Which engine instance serves a request.

Score of an instance (higher wins), from what its last /state said plus the gateway's own
in-flight count:

    score = ADAPTER[tier] + prefix_weight * matched / prompt_len - load_weight * load

- tier: the adapter is resident in a slot (3) > a slot is free under max_loras (2) > an idle
  resident adapter must be evicted (1) > every slot is busy (0, the request would wait for
  one). Base-model requests are tier 3 everywhere. An adapter of a request this gateway sent
  there and that has not ended counts as resident and busy at once (gateway/instances.py
  slot_claims): a burst of new adapters fills an instance's free slots, then goes elsewhere,
  instead of all seeing the same free slots until the next poll.
- matched: the longest prefix of the prompt this instance has cached, from the published
  sparse chain hashes (computed with the engines' own hashing), in tokens.
- load: in_flight / max_num_seqs + kv_usage.

An instance that a request's prompt_cache_key last went to (gateway/cache_key_affinity.py)
counts as matching the whole prompt.

Prefix affinity yields under imbalance: an instance whose load exceeds the least-loaded
candidate's by more than ``imbalance`` gets no prefix credit, so a hot prefix spreads to a
second instance instead of queueing on one. The same rule places adapters: when the
resident instance is busy, a less-loaded instance with a free slot outscores it and loads
the adapter there, so a popular adapter ends up resident on two instances.

Instances at their admission bound (in_flight >= max_in_flight) are not candidates; the
caller answers 429 when every healthy instance is full and 503 when none is healthy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

RoutingPolicy = Literal["score", "round_robin"]
ADAPTER_TIER_SCORE = (0.0, 1.0, 2.0, 3.0)
TIER_REASONS = ("adapter_slots_busy", "adapter_evict", "adapter_free_slot",
                "adapter_resident")


@dataclass(frozen=True)
class Candidate:
    """One instance as the router sees it for one request."""

    instance_id: str
    in_flight: int
    max_in_flight: int
    max_num_seqs: int
    kv_usage: float
    max_loras: int
    resident: frozenset[str]
    """Adapters in its slots, or claimed by this gateway's requests there."""
    busy_adapters: frozenset[str]
    """Resident adapters that cannot be evicted (running requests or pinned)."""
    matched_tokens: int = 0
    key_affine: bool = False
    """Where the request's prompt_cache_key last went: credited with the whole prompt."""

    @property
    def load(self) -> float:
        return self.in_flight / max(1, self.max_num_seqs) + self.kv_usage

    def adapter_tier(self, adapter: str | None) -> int:
        if adapter is None or adapter in self.resident:
            return 3
        if len(self.resident) < self.max_loras:
            return 2
        if len(self.busy_adapters) < self.max_loras:
            return 1
        return 0


@dataclass(frozen=True)
class RoutingDecision:
    """The chosen instance, why, and every candidate's score (for logs and debug headers)."""

    instance_id: str
    reason: str
    scores: dict[str, float] = field(default_factory=dict)
    matched_tokens: int = 0

    def explain(self) -> str:
        scores = ",".join(f"{k}={v:.3f}" for k, v in sorted(self.scores.items()))
        return (f"instance={self.instance_id} reason={self.reason} "
                f"matched={self.matched_tokens} scores={scores}")


@dataclass(frozen=True)
class RouterWeights:
    """Weights of the score terms; the adapter tier dominates (a step of 1 per tier)."""

    prefix: float = 2.0
    load: float = 1.0
    imbalance: float = 0.5
    """Load gap (in units of load) beyond which prefix affinity stops counting."""


class Router:
    """Stateless scoring (score policy) or a rotating cursor (round_robin policy)."""

    def __init__(self, policy: RoutingPolicy = "score", weights: RouterWeights | None = None
                 ) -> None:
        if policy not in ("score", "round_robin"):
            raise ValueError(f"routing policy must be 'score' or 'round_robin', got {policy!r}")
        self.policy = policy
        self.weights = weights or RouterWeights()
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Candidate], adapter: str | None, prompt_len: int
               ) -> RoutingDecision | None:
        """Best candidate with room, or None when every candidate is at its bound."""
        open_ = [c for c in candidates if c.in_flight < c.max_in_flight]
        if not open_:
            return None
        if self.policy == "round_robin":
            ordered = sorted(open_, key=lambda c: c.instance_id)
            pick = ordered[next(self._turn) % len(ordered)]
            return RoutingDecision(pick.instance_id, "round_robin",
                                   matched_tokens=pick.matched_tokens)
        min_load = min(c.load for c in open_)
        scores: dict[str, float] = {}
        parts: dict[str, tuple[float, float]] = {}
        for c in open_:
            prefix = 1.0 if c.key_affine else c.matched_tokens / max(1, prompt_len)
            if c.load - min_load > self.weights.imbalance:
                prefix = 0.0
            prefix_term = self.weights.prefix * prefix
            scores[c.instance_id] = (ADAPTER_TIER_SCORE[c.adapter_tier(adapter)] + prefix_term
                                     - self.weights.load * c.load)
            parts[c.instance_id] = (prefix_term, c.load)
        best = max(open_, key=lambda c: (scores[c.instance_id], -c.in_flight, c.instance_id))
        return RoutingDecision(best.instance_id, self._reason(best, open_, adapter, parts),
                               scores, best.matched_tokens)

    @staticmethod
    def _reason(best: Candidate, candidates: Sequence[Candidate], adapter: str | None,
                parts: dict[str, tuple[float, float]]) -> str:
        """The term that set the winner apart, for metrics by reason."""
        tier = best.adapter_tier(adapter)
        if adapter is not None and any(c.adapter_tier(adapter) < tier for c in candidates):
            return TIER_REASONS[tier]
        prefix_term = parts[best.instance_id][0]
        if prefix_term > 0 and any(parts[c.instance_id][0] < prefix_term for c in candidates):
            return "prompt_cache_key" if best.key_affine else "prefix"
        if len(candidates) > 1:
            return "least_loaded"
        return "only_candidate"
