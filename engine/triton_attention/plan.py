"""The step's inputs to the Triton attention kernels, built once per step on the host and
moved to the device in one copy, and the call that runs them for one layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

BlockTable = Sequence[int] | npt.NDArray[np.int64]


@dataclass(frozen=True)
class TritonAttentionPlan:
    """Device tensors (all int32) of one step's decodes (flat rows 0..num_decodes-1) and
    prefill chunks (the rows after them), for every layer of one sliding window."""

    num_decodes: int
    decode_block_tables: torch.Tensor
    """[num_decodes, W] each decode's blocks in position order, zero-padded."""
    decode_context_lens: torch.Tensor
    """[num_decodes] positions each decode reads (its own included)."""
    max_decode_context: int
    prefill_block_tables: torch.Tensor
    """[num_chunks, W'] each chunk's request's blocks, covering prefix and chunk."""
    tile_seq: torch.Tensor
    """[num_tiles] chunk of each prefill tile (engine/triton_attention/prefill.py)."""
    tile_first: torch.Tensor
    """[num_tiles] first query of each tile within its chunk."""
    query_start: torch.Tensor
    """[num_chunks] flat row of each chunk's first query."""
    query_len: torch.Tensor
    start_pos: torch.Tensor
    """[num_chunks] position of each chunk's first query (= its cached prefix length)."""
    block_m: int
    sliding_window: int | None = None

    def with_window(self, sliding_window: int | None) -> TritonAttentionPlan:
        """The same tensors for layers of another sliding window (no new copies)."""
        return dataclasses.replace(self, sliding_window=sliding_window)


def default_block_m(device: torch.device) -> int:
    """Queries per prefill tile: 64 on a GPU; 16 in the interpreter, whose cost grows with
    the tile and which tests with chunks of a few dozen tokens."""
    return 64 if device.type == "cuda" else 16


def prefill_tile_map(query_lens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """(request index, first query) of every BLOCK_M-query tile of every chunk, in order."""
    seqs: list[int] = []
    firsts: list[int] = []
    for i, q_len in enumerate(query_lens):
        for first in range(0, q_len, block_m):
            seqs.append(i)
            firsts.append(first)
    return seqs, firsts


def _table(rows: Sequence[tuple[BlockTable, int]], block_size: int) -> npt.NDArray[np.int32]:
    """[len(rows), widest] block ids covering each row's positions, zero-padded."""
    width = max((-(-length // block_size) for _, length in rows), default=0)
    table = np.zeros((len(rows), max(width, 1)), dtype=np.int32)
    for i, (blocks, length) in enumerate(rows):
        used = -(-length // block_size)
        table[i, :used] = np.asarray(blocks[:used], dtype=np.int32)
    return table


def build_triton_plan(
    decodes: Sequence[tuple[BlockTable, int]],
    prefills: Sequence[tuple[BlockTable, int, int]],
    block_size: int, sliding_window: int | None, device: torch.device, block_m: int,
) -> TritonAttentionPlan:
    """decodes: (block_table, context_len) per one-token request, in batch order;
    prefills: (block_table, start_pos, q_len) per chunk, after the decodes; block_m: queries
    per prefill tile (engine/triton_attention/prefill.py default_tiles)."""
    decode_table = _table(decodes, block_size)
    lens = np.array([ctx for _, ctx in decodes], dtype=np.int32)
    prefill_table = _table([(bt, start + q_len) for bt, start, q_len in prefills], block_size)
    q_lens = [q_len for _, _, q_len in prefills]
    starts = np.cumsum([len(decodes), *q_lens[:-1]]) if prefills else np.zeros(0)
    seqs, firsts = prefill_tile_map(q_lens, block_m)
    # Everything in one int32 buffer: one host-to-device copy per step, then views.
    parts = [decode_table.ravel(), lens, prefill_table.ravel(),
             np.asarray(seqs, dtype=np.int32), np.asarray(firsts, dtype=np.int32),
             np.asarray(starts, dtype=np.int32), np.asarray(q_lens, dtype=np.int32),
             np.asarray([start for _, start, _ in prefills], dtype=np.int32)]
    flat = torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)
    views = list(torch.split(flat, [p.size for p in parts]))
    return TritonAttentionPlan(
        num_decodes=len(decodes),
        decode_block_tables=views[0].view(decode_table.shape),
        decode_context_lens=views[1],
        max_decode_context=int(lens.max()) if lens.size else 0,
        prefill_block_tables=views[2].view(prefill_table.shape),
        tile_seq=views[3], tile_first=views[4], query_start=views[5], query_len=views[6],
        start_pos=views[7], block_m=block_m, sliding_window=sliding_window)


def triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: TritonAttentionPlan, scale: float,
                     softcap: float | None = None) -> torch.Tensor:
    """The step's attention for one layer whose K/V are already in the cache: decodes with
    the split decode kernel, chunks with the prefill kernel. q [T, H, D] -> [T, H, D]."""
    from engine.triton_attention.decode import paged_decode_attention
    from engine.triton_attention.prefill import paged_prefill_attention

    out = torch.empty_like(q)
    if plan.num_decodes:
        paged_decode_attention(
            q[:plan.num_decodes], k_cache, v_cache, plan.decode_block_tables,
            plan.decode_context_lens, plan.max_decode_context, scale,
            sliding_window=plan.sliding_window, softcap=softcap, out=out[:plan.num_decodes])
    paged_prefill_attention(
        q, k_cache, v_cache, out, plan.prefill_block_tables, plan.tile_seq, plan.tile_first,
        plan.query_start, plan.query_len, plan.start_pos, scale,
        sliding_window=plan.sliding_window, softcap=softcap, block_m=plan.block_m)
    return out
