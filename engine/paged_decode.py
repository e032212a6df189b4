"""Decode attention for many requests in one call: contexts copied out block-wise, the query
heads that share a KV head folded into the query length, one flash call with a length mask.

A decode is one query per request against its own context. Run per request, a CPU step pays
an attention call (thread fork/join, tiling set-up) per decode per layer, far more than the
attention itself at these sizes. Run as one padded batch with grouped-query attention
expressed through ``enable_gqa``, torch falls back to a path that repeats K/V per query head.
Here the whole step's decodes (or, under cascade attention, the blocks only one decode holds)
are one call: K/V copied out of the cache whole blocks at a time (a contiguous copy per
block), the G query heads of each KV head as G query rows (no repetition of K/V), the
padding and any sliding window hidden by a mask. Measured on the 2-core host with
SmolLM2-135M (32 decodes of ~300 positions): the whole decode forward 70 ms, against 98 ms
with one flash call per decode and 220 ms with the enable_gqa batch.

The copies go to buffers kept from step to step (CopyBuffers): a fresh allocation of that size
per layer is fresh pages from the kernel each time, and those page faults cost more than the
attention (measured: decode step 210 ms with fresh copies, ~100 ms reusing them).

The CPU flash kernel also returns the log-sum-exp that cascade attention needs to merge
partial results; other devices run torch's SDPA, and soft-capped scores (Gemma 2) explicit
matmuls, neither of which returns one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from engine.cpu_kernels import PagedDecodeOp

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class CopyBuffers:
    """Space the K/V copies are written to, grown on demand and reused by every layer and
    step of one engine. Only that engine's thread may use it (one copy in flight at once)."""

    def __init__(self) -> None:
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two tensors of ``shape`` with like's dtype and device, valid until the next take."""
        numel = math.prod(shape)
        if (self._keys is None or self._values is None or self._keys.numel() < numel
                or self._keys.dtype != like.dtype or self._keys.device != like.device):
            self._keys = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._values = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self._keys[:numel].view(shape), self._values[:numel].view(shape)


@dataclass(frozen=True)
class DecodeBatch:
    """Decodes for one attention call: each a query row and the cached positions it reads."""

    rows: torch.Tensor
    """[N] int64 flat-batch row of each decode's query."""
    block_tables: torch.Tensor
    """[N, B] int64: each decode's blocks in position order, zero-padded."""
    bias: torch.Tensor
    """[N, 1, 1, B * block_size] float32 added to the scores: 0 at a real, in-window
    position, -inf elsewhere (torch's CPU flash kernel takes no boolean mask). Empty when
    ``kernel`` is set (it reads ``lengths`` and the window instead)."""
    buffers: CopyBuffers | None = None
    """Where the K/V copies go (None: fresh tensors each call)."""
    lengths: torch.Tensor | None = None
    """[N] int64 positions each decode reads (set with ``kernel``)."""
    sliding_window: int | None = None
    kernel: PagedDecodeOp | None = None
    """The compiled kernel (engine/cpu_kernels) that reads the cache in place: no copies, no
    padding, so all the step's decodes are one batch whatever their lengths."""


# Decodes sorted by length are cut into batches where a batch's shortest context would be
# padded to more than 1/_BATCH_FILL of itself; a cut is worth it only when the padding it
# saves exceeds the cost of one more call (about _CALL_COST_BLOCKS blocks of one row's
# attention, measured on the 2-core host: ~4 us per row-block, ~80 us per call). With
# contexts of 40-760 positions, 32 decodes: one batch 100 ms per step, cut 41-46 ms.
_BATCH_FILL = 0.7
_CALL_COST_BLOCKS = 20


def build_decode_batches(
    decodes: Sequence[tuple[int, Sequence[int] | npt.NDArray[np.int64], int]],
    block_size: int, device: torch.device, sliding_window: int | None = None,
    buffers: CopyBuffers | None = None, kernel: PagedDecodeOp | None = None,
) -> list[DecodeBatch]:
    """The decodes as batches of similar context length (longest first), or all in one
    batch for ``kernel``; arguments as for build_decode_batch. No decodes, no batches."""
    if not decodes:
        return []
    if kernel is not None:
        return [build_decode_batch(decodes, block_size, device, sliding_window, kernel=kernel)]
    order = sorted(decodes, key=lambda d: d[2], reverse=True)
    groups: list[list[tuple[int, Sequence[int] | npt.NDArray[np.int64], int]]] = []
    widest = 0
    for i, decode in enumerate(order):
        width = -(-decode[2] // block_size)
        saved = (widest - width) * (len(order) - i)  # padding avoided if cut here
        if not groups or (width < _BATCH_FILL * widest and saved > _CALL_COST_BLOCKS):
            groups.append([])
            widest = width
        groups[-1].append(decode)
    return [build_decode_batch(group, block_size, device, sliding_window, buffers)
            for group in groups]


def build_decode_batch(
    decodes: Sequence[tuple[int, Sequence[int] | npt.NDArray[np.int64], int]],
    block_size: int, device: torch.device, sliding_window: int | None = None,
    buffers: CopyBuffers | None = None, kernel: PagedDecodeOp | None = None,
) -> DecodeBatch:
    """decodes: (flat-batch row, blocks, positions) each, at least one, with at least
    ceil(positions / block_size) blocks. sliding_window: attend to the last that many
    positions only. buffers: the engine's copy space. kernel: attend with it instead."""
    width = max(-(-length // block_size) for _, _, length in decodes)
    table = np.zeros((len(decodes), width), dtype=np.int64)
    for i, (_, blocks, length) in enumerate(decodes):
        used = -(-length // block_size)
        table[i, :used] = blocks[:used]
    lengths = torch.tensor([length for _, _, length in decodes], dtype=torch.int64)
    rows = torch.tensor([row for row, _, _ in decodes], dtype=torch.int64, device=device)
    if kernel is not None:
        return DecodeBatch(rows=rows, block_tables=torch.from_numpy(table).to(device),
                           bias=torch.empty(0), lengths=lengths.to(device),
                           sliding_window=sliding_window, kernel=kernel)
    positions = torch.arange(width * block_size, dtype=torch.int64)[None, :]
    hidden = positions >= lengths[:, None]
    if sliding_window is not None:
        hidden |= positions < lengths[:, None] - sliding_window
    bias = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
    return DecodeBatch(
        rows=rows, block_tables=torch.from_numpy(table).to(device),
        bias=bias[:, None, None, :].to(device), buffers=buffers)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: DecodeBatch, scale: float, softcap: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each decode's query attends to its masked context.

    Shapes: q [T, H, D] (the step's flat batch; the batch's rows are read); caches
    [num_blocks, block_size, Hkv, D]; H a multiple of Hkv. Returns out [N, H, D] in batch
    order, in q's dtype, and lse [N, H] float32 (the log-sum-exp of the scaled scores) from
    the CPU flash kernel or the compiled one, else None. softcap: scores =
    softcap * tanh(scores / softcap)."""
    if batch.kernel is not None:
        assert batch.lengths is not None
        return batch.kernel(q.index_select(0, batch.rows), k_cache, v_cache, batch.block_tables,
                            batch.lengths, scale, softcap or 0.0, batch.sliding_window or 0)
    n, num_blocks = batch.block_tables.shape
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    length = num_blocks * block_size
    blocks = batch.block_tables.reshape(-1)
    if batch.buffers is not None:
        keys, values = batch.buffers.take((blocks.numel(), *k_cache.shape[1:]), k_cache)
        torch.index_select(k_cache, 0, blocks, out=keys)
        torch.index_select(v_cache, 0, blocks, out=values)
    else:
        keys, values = k_cache.index_select(0, blocks), v_cache.index_select(0, blocks)
    # [N, L, Hkv, D] -> [N, Hkv, L, D] strided views of the copies.
    keys = keys.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
    values = values.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
    queries = q.index_select(0, batch.rows).view(n, num_kv_heads, group, head_dim)
    lse = None
    if softcap is not None:
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * scale
        scores = torch.tanh(scores / softcap) * softcap + batch.bias
        out = torch.matmul(torch.softmax(scores, -1).to(q.dtype), values)
        return out.reshape(n, num_kv_heads * group, head_dim), None
    bias = batch.bias.to(q.dtype)  # no copy for float32
    if _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(queries, keys, values, 0.0, False, attn_mask=bias, scale=scale)
        lse = lse.reshape(n, num_kv_heads * group)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias,
                                             scale=scale)
    return out.reshape(n, num_kv_heads * group, head_dim), lse
