"""Cascade attention through the compiled span kernel: one call per layer.

The flash path of engine/cascade_attention.py runs a torch flash call per node span and per
prefill-chunk piece, then merges the partial results with a dozen torch ops. Here the same
plan becomes the inputs of ``loragate::span_attention`` (engine/cpu_kernels/
span_attention.cpp): one item per node span (that node's query rows against keys read in
place), one causal item per prefill chunk over its own K/V (whole: the kernel skips the
masked tiles, so chunks need no pieces), and for each flat-batch row the list of partial
results to merge, the decodes' private tails (the compiled decode kernel's output) among
them. Built once per step, executed once per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cpu_kernels import SpanAttentionOp
from engine.paged_decode import DecodeBatch, decode_attention

if TYPE_CHECKING:
    from engine.cascade_attention import CascadeNode

SOURCE_IDS = {"cache": 0, "copy": 1, "step": 2}
"""Where an item's keys are read (span_attention.cpp's ``source``)."""

SPAN_HEAD_DIMS = (32, 64, 128, 256)
"""Head sizes the kernel is compiled for (float32 only)."""


def span_kernel_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the span kernel can run cascade attention for caches of this dtype and head
    size (the engine's runner and the forward benchmark ask alike)."""
    return dtype == torch.float32 and head_dim in SPAN_HEAD_DIMS


@dataclass(frozen=True)
class SpanPlan:
    """A step's inputs of the span kernel (shapes and semantics in span_attention.cpp)."""

    op: SpanAttentionOp
    items: torch.Tensor
    """[I, 6] int64: (source, key_start, key_len, rows_offset, num_rows, diag) each."""
    rows: torch.Tensor
    """[N] int64: every item's query rows, item after item."""
    merge_offsets: torch.Tensor
    """[R + 1] int64: row r's partials are merge_parts[merge_offsets[r]:merge_offsets[r+1]]."""
    merge_parts: torch.Tensor
    """[M] int64: a partial's index, the private tails' rows first, then the items' rows."""


def build_span_plan(op: SpanAttentionOp, nodes: Sequence[CascadeNode],
                    chunks: Sequence[tuple[int, int]], private: Sequence[DecodeBatch],
                    num_rows: int) -> SpanPlan:
    """nodes: the radix tree's nodes (no chunk pieces); chunks: (first row, rows) of each
    prefill chunk, attending causally to its own K/V; private: the decodes' private tails;
    num_rows: rows of the flat batch."""
    items: list[tuple[int, int, int, int, int, int]] = []
    rows: list[torch.Tensor] = []
    offset = 0
    for node in nodes:
        n = node.query_rows.numel()
        for span in node.spans:
            items.append((SOURCE_IDS[span.source], span.start, span.length, offset, n, -1))
            rows.append(node.query_rows)
            offset += n
    for first, n in chunks:
        items.append((SOURCE_IDS["step"], first, n, offset, n, 0))
        rows.append(torch.arange(first, first + n))
        offset += n
    item_rows = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
    prior_rows = [batch.rows.cpu() for batch in private]
    every = torch.cat([*prior_rows, item_rows]).numpy()
    # Partials grouped by the row they belong to (stable: a row's parts in plan order).
    order = np.argsort(every, kind="stable")
    counts = np.bincount(every, minlength=num_rows)
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return SpanPlan(
        op=op,
        items=torch.tensor(items, dtype=torch.int64).reshape(-1, 6),
        rows=item_rows,
        merge_offsets=torch.from_numpy(offsets),
        merge_parts=torch.from_numpy(order.astype(np.int64)),
    )


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def span_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, gather_blocks: torch.Tensor,
                   private: Sequence[DecodeBatch], plan: SpanPlan, scale: float
                   ) -> torch.Tensor:
    """Cascade attention (same semantics and shapes as cascade_attention) in one kernel
    call after the private tails' decode call; float32 only."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    outs, lses = [], []
    for batch in private:
        out, lse = decode_attention(q, k_cache, v_cache, batch, scale)
        assert lse is not None  # a CPU with the flash kernel or the compiled one
        outs.append(out)
        lses.append(lse)
    prior_out = torch.cat(outs) if outs else q.new_empty(0, num_heads, head_dim)
    prior_lse = torch.cat(lses) if lses else q.new_empty(0, num_heads)
    if gather_blocks.numel():
        k_copy = k_cache.index_select(0, gather_blocks)
        v_copy = v_cache.index_select(0, gather_blocks)
    else:
        k_copy = v_copy = k_cache[:0]
    return plan.op(_heads_contiguous(q), k_cache, v_cache, k_copy, v_copy,
                   _heads_contiguous(k), _heads_contiguous(v), plan.items, plan.rows,
                   prior_out, prior_lse, plan.merge_offsets, plan.merge_parts, scale)
