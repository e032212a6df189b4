"""The model runner's own copies of the running requests, and the persistent buffers one
step's flat inputs are written into.

The scheduler sends a request whole once (NewRequest: its tokens so far, sampling
parameters, adapter slot) and deltas after that (ScheduledChunk: the blocks its table
gained, how many tokens to run). The runner appends each token it samples to its copy, so a
decode costs the runner one list index and the scheduler nothing per token. A request the
scheduler stops running (finished, preempted, rolled back) is forgotten here and, if it
runs again, sent whole again.

Block tables live in one persistent [max_num_seqs, max_blocks_per_seq] array, a row per
running request, so a step's decode tables are one gather, not a tensor built from lists.
Inputs are staged in fixed host buffers sized for a full step (max_num_batched_tokens
rows), pinned on CUDA, and copied into device buffers of the same size: the tensors the
model reads live at fixed addresses, as static device buffers (CUDA graphs) need.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from engine.kv_cache import blocks_for
from engine.logits_processors import RowState
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledChunk, SchedulerOutput


@dataclass(slots=True)
class RunningRequest:
    """The runner's copy of one running request."""

    token_ids: list[int]
    """Every token known: those the scheduler sent, then those the runner sampled."""
    row: int
    """Its row of the block-table array."""
    num_blocks: int
    """Blocks of its table (the first num_blocks entries of its row)."""
    sampling_params: SamplingParams
    lora_slot: int
    num_prompt_tokens: int


@dataclass
class StepInputs:
    """One step's flat inputs, decodes first (views of the persistent buffers)."""

    input_ids: torch.Tensor
    """[T] int64 on the device."""
    positions: torch.Tensor
    """[T] int64 on the device."""
    token_slots: torch.Tensor
    """[T] int64 on the host: adapter slot of each token (-1: none)."""
    sample_rows: torch.Tensor
    """[S] int64 on the device: the last row of each chunk that samples."""
    decodes: list[tuple[npt.NDArray[np.int64], int]]
    """(block table, context length) of each one-token chunk."""
    decode_rows: list[int]
    """The decodes' rows of InputBatch.tables, in batch order."""
    prefills: list[tuple[npt.NDArray[np.int64], int, int]]
    """(block table, start position, tokens) of each longer chunk."""
    has_lora: bool


class InputBatch:
    """Running requests by id, kept current by apply() and append_sampled()."""

    # Rows of the staging buffers: token ids, positions, adapter slots.
    _IDS, _POS, _SLOTS = range(3)

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, max_num_tokens: int,
                 block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, RunningRequest] = {}
        self._tables = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int64)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        pin = device.type == "cuda"
        self._host = torch.zeros((3, max_num_tokens), dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        # On a CPU engine the host buffers are the device buffers.
        self._device = (self._host[:2] if device.type == "cpu" else
                        torch.zeros((2, max_num_tokens), dtype=torch.int64, device=device))

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self._free_rows.append(request.row)

    @property
    def tables(self) -> npt.NDArray[np.int64]:
        """[max_num_seqs, max_blocks] every running request's block table, at its row;
        entries past a request's blocks are stale."""
        return self._tables

    def block_table(self, request_id: str) -> npt.NDArray[np.int64]:
        """The request's block table: a view of its row, valid until the next apply()."""
        request = self.requests[request_id]
        return self._tables[request.row, :request.num_blocks]

    def apply(self, sched: SchedulerOutput) -> None:
        """Take a step's changes: drop the requests that stopped running, add the new ones,
        grow the block tables. Raises AssertionError if a chunk does not match the copy
        (a scheduler / runner disagreement, never client input)."""
        self.forget(sched.finished_request_ids)
        self.forget(sched.preempted_request_ids)
        for new in sched.new_requests:
            self.forget([new.request_id])  # a copy left by a step that never reached here
            assert self._free_rows, "more running requests than max_num_seqs"
            self.requests[new.request_id] = RunningRequest(
                new.token_ids, self._free_rows.pop(), 0, new.sampling_params, new.lora_slot,
                new.num_prompt_tokens)
        for c in sched.chunks:
            request = self.requests[c.request_id]
            end = request.num_blocks + len(c.new_block_ids)
            self._tables[request.row, request.num_blocks:end] = c.new_block_ids
            request.num_blocks = end
            known = len(request.token_ids)
            assert c.context_len == known if c.sample else c.context_len < known, (
                f"{c.request_id}: chunk ends at {c.context_len}, runner knows {known} tokens")
            assert blocks_for(c.context_len, self.block_size) <= end, (
                f"{c.request_id}: block table too short for {c.context_len} tokens")

    def append_sampled(self, request_id: str, token_id: int) -> None:
        self.requests[request_id].token_ids.append(token_id)

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Write the step's inputs (chunks in batch order, decodes first) into the staging
        buffers and start their copy to the device. The next prepare() overwrites them: the
        step in between ends with the sampler reading its tokens back, which waits for the
        copy."""
        ids, pos, slots = (self._host_np[row] for row in (self._IDS, self._POS, self._SLOTS))
        decodes: list[tuple[npt.NDArray[np.int64], int]] = []
        decode_rows: list[int] = []
        prefills: list[tuple[npt.NDArray[np.int64], int, int]] = []
        sample_rows: list[int] = []
        has_lora = False
        t = 0
        for c in chunks:
            request = self.requests[c.request_id]
            table = self._tables[request.row, :request.num_blocks]
            n, start = c.num_tokens, c.start_pos
            if n == 1:
                ids[t] = request.token_ids[start]
                pos[t] = start
                decodes.append((table, start + 1))
                decode_rows.append(request.row)
            else:
                ids[t:t + n] = request.token_ids[start:start + n]
                pos[t:t + n] = np.arange(start, start + n)
                prefills.append((table, start, n))
            slots[t:t + n] = request.lora_slot
            has_lora |= request.lora_slot >= 0
            t += n
            if c.sample:
                sample_rows.append(t - 1)
        if self._device.data_ptr() != self._host.data_ptr():
            self._device[:, :t].copy_(self._host[:2, :t], non_blocking=True)
        return StepInputs(
            input_ids=self._device[self._IDS, :t], positions=self._device[self._POS, :t],
            token_slots=self._host[self._SLOTS, :t],
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
            decodes=decodes, decode_rows=decode_rows, prefills=prefills, has_lora=has_lora)

    def row_states(self, request_ids: list[str]) -> list[RowState]:
        """What sampling needs of each request besides the logits."""
        states = []
        for request_id in request_ids:
            r = self.requests[request_id]
            longest = max((len(w) for w in r.sampling_params.bad_words_token_ids), default=1)
            states.append(RowState(r.sampling_params, len(r.token_ids) - r.num_prompt_tokens,
                                   r.token_ids[max(r.num_prompt_tokens,
                                                   len(r.token_ids) - longest + 1):],
                                   r.row))
        return states
