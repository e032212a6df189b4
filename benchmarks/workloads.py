"""Seeded synthetic workloads: each request is prompt token ids plus an exact output length.

Token ids are drawn uniformly from the model's vocabulary minus the special ids, so no
prompt contains BOS/EOS/PAD or chat markers; requests are meant to run with ignore_eos (the
engine) or min_new_tokens (transformers) so that every request produces exactly
``output_len`` tokens and both sides do the same work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NUM_SPECIAL_IDS = 5
"""Ids 0..4 are the demo model's special tokens (<s>, </s>, <pad>, <|im_start|>, <|im_end|>)."""


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: the prompt and how many tokens it must generate."""

    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class LengthRange:
    """Inclusive [low, high] range that lengths are drawn from uniformly."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got low={self.low}, high={self.high}")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True)
class WorkloadSpec:
    """A seeded workload: how many requests, their length ranges and the token id range."""

    num_requests: int
    prompt_len: LengthRange
    output_len: LengthRange
    vocab_size: int
    seed: int = 0
    first_token_id: int = NUM_SPECIAL_IDS

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.vocab_size <= self.first_token_id:
            raise ValueError(f"vocab_size ({self.vocab_size}) must exceed first_token_id "
                             f"({self.first_token_id})")


def mixed_workload(num_requests: int, vocab_size: int, seed: int = 0) -> WorkloadSpec:
    """The throughput benchmark's mix: prompts of 32-512 tokens, outputs of 16-256 tokens."""
    return WorkloadSpec(num_requests, LengthRange(32, 512), LengthRange(16, 256), vocab_size, seed)


def decode_heavy_workload(num_requests: int, vocab_size: int, prompt_len: int = 128,
                          output_len: int = 1024, seed: int = 0) -> WorkloadSpec:
    """Equal prompts and long outputs: after the prefill every request is decoding."""
    return WorkloadSpec(num_requests, LengthRange(prompt_len, prompt_len),
                        LengthRange(output_len, output_len), vocab_size, seed)


def generate(spec: WorkloadSpec) -> list[BenchRequest]:
    """The spec's requests; the same spec always gives the same requests."""
    rng = random.Random(spec.seed)
    high = spec.vocab_size - 1
    requests = []
    for _ in range(spec.num_requests):
        prompt_len = spec.prompt_len.draw(rng)
        output_len = spec.output_len.draw(rng)
        prompt = tuple(rng.randint(spec.first_token_id, high) for _ in range(prompt_len))
        requests.append(BenchRequest(prompt, output_len))
    return requests


def total_output_tokens(requests: list[BenchRequest]) -> int:
    return sum(r.output_len for r in requests)
