"""The plain dataclasses that cross from the scheduler to the model runner: a request in
full the first time it runs (or runs again after a preemption), deltas after that."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from lora.adapter import LoraAdapter


@dataclass
class NewRequest:
    """A request the runner does not hold: its first schedule, or its return after a
    preemption (by recompute or swap). The runner keeps its own copy from here on and gets
    only deltas (ScheduledChunk) until the request finishes or is preempted again."""

    request_id: str
    token_ids: list[int]
    """Every token known so far (prompt, then output); a list the runner may keep."""
    sampling_params: SamplingParams
    num_prompt_tokens: int
    """How many of token_ids are the prompt (the rest are output)."""
    lora_slot: int = -1
    """Adapter slot of every token of the request while it runs (-1: base model only)."""


@dataclass
class ScheduledChunk:
    """Positions [start_pos, start_pos + num_tokens) of one request to run this step.

    ``new_block_ids`` extend the runner's block table of the request (for a NewRequest they
    are the whole table); the table then covers every position of the chunk. The token ids
    are the runner's own copy: the tokens it was sent, plus the ones it sampled. When
    ``sample`` is set the chunk reaches the last known token, so the runner samples the
    request's next token from its last row.
    """

    request_id: str
    start_pos: int
    num_tokens: int
    new_block_ids: list[int]
    sample: bool

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step; it never reads scheduler state.

    The runner applies it in this order: forget the finished and preempted requests, take
    the new ones, extend the block tables of every chunk, copy blocks (swap-outs first: a
    device block freed by a swap-out may be written by this very step), load adapters, run.
    """

    new_requests: list[NewRequest] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    """One per scheduled request, new ones included."""
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, cpu block) pairs to copy out."""
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(cpu block, device block) pairs to copy in."""
    lora_loads: list[tuple[int, LoraAdapter]] = field(default_factory=list)
    """(slot, adapter) weights to copy into the slot buffers before the forward."""
    preempted_request_ids: list[str] = field(default_factory=list)
    """Requests that stopped running in this step; the runner forgets its copies of them."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that ended since the previous step; the runner forgets them and their sampler
    state."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.lora_loads)
