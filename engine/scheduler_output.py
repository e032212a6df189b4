"""The one plain dataclass that crosses from the scheduler to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from lora.adapter import LoraAdapter


@dataclass
class ScheduledChunk:
    """Tokens of one request to run this step.

    token_ids are the tokens at positions [start_pos, start_pos + len(token_ids)); their KV
    goes into block_table, which already covers all of them. The request's context after
    this step is start_pos + len(token_ids). When ``sample`` is set the chunk reaches the
    last known token, so the runner samples the request's next token from its last row.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    lora_slot: int = -1
    """Adapter slot of every token of the chunk (-1: base model only)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step; it never reads scheduler state.

    Copies run before the forward, swap-outs first: a device block freed by a swap-out may be
    written by this very step.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, cpu block) pairs to copy out."""
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(cpu block, device block) pairs to copy in."""
    lora_loads: list[tuple[int, LoraAdapter]] = field(default_factory=list)
    """(slot, adapter) weights to copy into the slot buffers before the forward."""
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that ended since the previous step; the runner drops their sampler state."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.lora_loads)
