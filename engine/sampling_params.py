"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_SEED = 2**64
"""Seeds are in [0, MAX_SEED): what a torch generator accepts."""
MAX_INT_FIELD = 2**31 - 1
"""Bound of every other integer field (max_tokens, top_k, token ids): far above any real
value, and small enough for every tensor dtype the sampler uses."""
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024
GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (dividing logits by them overflows)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters, validated at construction.

    temperature == 0 (or below GREEDY_BELOW) means greedy (top_k / top_p / seed are then
    ignored); top_k 0 or -1 disables top-k. ``seed`` gives the
    request its own generator, so its samples do not depend on which other requests share
    its batches. ``logprobs``: None returns no logprobs; k >= 0 returns the chosen token's
    logprob plus the k most likely alternatives (of the model's raw distribution).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a lone string is a common slip: accept it as one stop
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:  # vLLM's spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        if self.n != 1:
            raise ValueError(f"n must be 1 (one completion per request), got {self.n}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT_FIELD:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_INT_FIELD}], got "
                             f"{self.max_tokens!r}")
        if (not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature)
                or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT_FIELD:
            raise ValueError(f"top_k must be an integer in [0, {MAX_INT_FIELD}] (0 or -1 "
                             f"disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer between 0 and 20, got "
                             f"{self.logprobs!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_LENGTH for s in self.stop):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of "
                             f"at most {MAX_STOP_LENGTH} characters")
        if any(not _is_int(t) or not 0 <= t <= MAX_INT_FIELD for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {MAX_INT_FIELD}], got "
                             f"{self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
