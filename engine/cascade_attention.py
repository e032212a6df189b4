"""Cascade attention: KV blocks shared by several requests are read once per step.

RAG batches share long prefixes (system prompt, popular documents) through the prefix
cache, so many running requests hold the same physical KV blocks. The reference path
(engine/attention.py) copies every request's whole context out of the paged cache, once per
request per layer. This path instead

1. builds, once per step, a radix tree over the batch's block tables: each node is a run of
   blocks held by exactly the same set of requests (a request's trailing partial block is
   always its own leaf);
2. per layer, runs attention for the queries of all a node's requests over the node's
   keys (no mask: every position of a node is before every one of those queries), reading
   stretches of consecutive blocks in place and copying scattered nodes out once;
3. runs each prefill chunk's attention to its own fresh K/V (no gather) in row pieces:
   a piece attends to the earlier pieces' keys without a mask (like a node) and causally
   to its own;
4. merges the partial results of each query row with their log-sum-exp weights (softmax
   over a union of disjoint key sets).

A chunk with no cached context (a prompt's first chunk) has nothing to merge with: it is one
causal call over its own K/V, written straight to the output. Measured on SmolLM2 with 8
fresh 512-token prompts (torch's profiler, 2 threads): on a quiet host the pieces' smaller
attention (0.64 s against 0.79 s) was eaten by their merges and copies (4.18 s against
4.04 s of CPU for the whole prefill); with another job on the cores, the 7 calls and merges
per layer cost far more (22.1 s against 14.4 s).

On a CPU in float32 with the compiled kernels (engine/cpu_kernels), steps 2-4 are one call
per layer of the span kernel instead (engine/cascade_spans.py): an item per node span, one
causal item per prefill chunk (its masked tiles skipped, so no pieces), and the merge.

The blocks only one decode holds (its whole context when nothing is shared) skip step 2:
all those private tails are one batched call per layer (engine/paged_decode.py) instead of
one flash call per request.

It needs the log-sum-exp of each partial attention, which torch's CPU flash-attention
kernel returns (``aten::_scaled_dot_product_flash_attention_for_cpu``); engines on other
devices, layers with a sliding window (Gemma's local layers; its global layers still cascade)
and models that soft-cap attention scores (Gemma 2) use the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from engine.cascade_spans import SpanPlan, build_span_plan, span_attention
from engine.cpu_kernels import PagedDecodeOp, SpanAttentionOp
from engine.paged_decode import CopyBuffers, DecodeBatch, build_decode_batches, decode_attention

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def cascade_available(device: torch.device) -> bool:
    """Whether this path can run on device (CPU with torch's flash kernel)."""
    return device.type == "cpu" and _FLASH_CPU is not None


@dataclass(frozen=True)
class CascadeRequest:
    """One request of the step as the planner sees it.

    block_table covers at least ``ceil(cached_len / block_size)`` blocks; positions
    [0, cached_len) are read from the cache; ``fresh`` says the query rows also attend
    causally to their own freshly computed K/V (a prefill chunk), which positions
    [cached_len, cached_len + q_len) hold.
    """

    block_table: list[int]
    cached_len: int
    query_start: int
    q_len: int
    fresh: bool


# A node whose blocks form fewer than one stretch of consecutive blocks per this many
# blocks is read in place (one attention call per stretch); a more scattered node is
# copied out of the cache first (one call). An attention call costs about as much as
# copying three blocks here (measured on the demo model, CPU).
_BLOCKS_PER_CALL = 3


# A prefill chunk's attention to its own K/V runs in pieces of this many query rows: piece
# i attends to pieces < i without a mask and causally to itself only. torch's CPU flash
# kernel computes the masked half of a causal call too (a 512-row causal call costs what an
# unmasked one does), so a 512-row chunk in 128-row pieces does 5/8 of the work.
FRESH_PIECE_ROWS = 128


@dataclass(frozen=True)
class KeySpan:
    """Consecutive key positions: ``length`` of them from ``start``, in the cache's slots
    (read in place), in the step's gathered copy of scattered blocks, or in the step's own
    freshly computed K/V (flat-batch rows)."""

    source: Literal["cache", "copy", "step"]
    start: int
    length: int


@dataclass(frozen=True)
class CascadeNode:
    """A run of cached positions read by the query rows of every request that holds it."""

    spans: list[KeySpan]
    query_rows: torch.Tensor
    """[Nq] int64 rows of the flat batch that attend to this node."""


@dataclass(frozen=True)
class CascadePlan:
    """Per-step plan shared by every layer."""

    gather_blocks: torch.Tensor
    """[G] int64 blocks of the scattered nodes, copied out once per layer."""
    nodes: list[CascadeNode]
    node_rows: torch.Tensor
    """[N] int64: every node's query rows, node after node (gathered once per layer)."""
    fresh: list[tuple[int, int]]
    """(first row, rows) of each prefill-chunk piece, attending causally to its own K/V."""
    whole: list[tuple[int, int]]
    """(first row, rows) of each chunk without cached context: one causal call, no merge."""
    merge_rows: torch.Tensor
    """[R] int64 flat-batch row of each partial result, in the order they are produced:
    each node's query rows once per span, then the fresh pieces' rows."""
    num_rows: int
    private: list[DecodeBatch]
    """The decodes' private tails as batched calls (their rows come first in merge_rows)."""
    spans: SpanPlan | None = None
    """Set when the compiled span kernel runs the step (engine/cascade_spans.py): nodes and
    whole prefill chunks as its items; fresh, whole and merge_rows are then unused."""


def _runs(blocks: list[int], block_size: int) -> list[KeySpan]:
    """The blocks' positions as spans of the cache, one per run of consecutive blocks."""
    spans: list[KeySpan] = []
    first = 0
    for j in range(1, len(blocks) + 1):
        if j == len(blocks) or blocks[j] != blocks[j - 1] + 1:
            spans.append(KeySpan("cache", blocks[first] * block_size, (j - first) * block_size))
            first = j
    return spans


def _cut(spans: list[KeySpan], cut: int) -> list[KeySpan]:
    """spans without the last ``cut`` positions of the last one (a partial last block)."""
    last = spans[-1]
    return [*spans[:-1], KeySpan(last.source, last.start, last.length - cut)]


def build_cascade_plan(requests: list[CascadeRequest], block_size: int,
                       device: torch.device,
                       fresh_piece_rows: int | None = None,
                       buffers: CopyBuffers | None = None,
                       kernel: PagedDecodeOp | None = None,
                       span_kernel: SpanAttentionOp | None = None) -> CascadePlan:
    """Radix tree over the requests' cached blocks -> nodes (a decode's private tail goes
    to the batched decodes instead), and each prefill chunk's pieces (of FRESH_PIECE_ROWS
    rows unless given). buffers: the engine's space for the private tails' K/V copies;
    kernel: the compiled decode kernel, which reads them in place instead; span_kernel:
    the compiled span kernel, which then runs nodes and whole chunks (float32 caches and a
    head size it was built for: the caller checks). See the module docstring."""
    piece_rows = fresh_piece_rows or FRESH_PIECE_ROWS
    keys: list[list[int]] = []
    for i, r in enumerate(requests):
        full, partial = divmod(r.cached_len, block_size)
        key = list(r.block_table[:full])
        if partial:
            # A negative id no other request has: a partial block is never shared.
            key.append(-1 - i)
        keys.append(key)
    rows = [torch.arange(r.query_start, r.query_start + r.q_len) for r in requests]
    nodes: list[CascadeNode] = []
    gather: list[int] = []
    tails: list[tuple[int, list[int], int]] = []  # (row, blocks, positions) of private tails
    order = sorted((i for i, k in enumerate(keys) if k), key=lambda i: keys[i])

    def emit(members: list[int], depth: int, end: int) -> None:
        blocks = keys[members[0]][depth:end]
        cut = 0
        if blocks[-1] < 0:  # a private partial block: cut to the request's length
            cut = -requests[members[0]].cached_len % block_size
            blocks[-1] = requests[members[0]].block_table[end - 1]
        only = requests[members[0]]
        if len(members) == 1 and only.q_len == 1 and not only.fresh:
            tails.append((only.query_start, blocks, len(blocks) * block_size - cut))
            return
        spans = _runs(blocks, block_size)
        if len(spans) * _BLOCKS_PER_CALL > len(blocks):
            spans = [KeySpan("copy", len(gather) * block_size, len(blocks) * block_size)]
            gather.extend(blocks)
        nodes.append(CascadeNode(_cut(spans, cut),
                                 torch.cat([rows[m] for m in members]).to(device)))

    # Iterative walk over groups of the sorted keys that share keys[:depth].
    stack: list[tuple[list[int], int]] = [(order, 0)] if order else []
    while stack:
        members, depth = stack.pop()
        first, last = keys[members[0]], keys[members[-1]]
        # Sorted order: the group's common prefix is that of its first and last keys.
        end = depth
        limit = min(len(first), len(last))
        while end < limit and first[end] == last[end]:
            end += 1
        if end > depth:
            emit(members, depth, end)
        rest = [m for m in members if len(keys[m]) > end]
        start = 0
        while start < len(rest):
            stop = start + 1
            while stop < len(rest) and keys[rest[stop]][end] == keys[rest[start]][end]:
                stop += 1
            stack.append((rest[start:stop], end))
            start = stop

    fresh: list[tuple[int, int]] = []
    whole: list[tuple[int, int]] = []
    for r in requests:
        if not r.fresh:
            continue
        if span_kernel is not None:  # the kernel skips a whole chunk's masked tiles
            whole.append((r.query_start, r.q_len))
            continue
        if r.cached_len == 0:
            whole.append((r.query_start, r.q_len))
            continue
        for lo in range(0, r.q_len, piece_rows):
            hi = min(r.q_len, lo + piece_rows)
            fresh.append((r.query_start + lo, hi - lo))
            if lo:  # the chunk's earlier rows, all before this piece's queries
                nodes.append(CascadeNode([KeySpan("step", r.query_start, lo)],
                                         torch.arange(r.query_start + lo,
                                                      r.query_start + hi).to(device)))
    private = build_decode_batches(tails, block_size, device, buffers=buffers, kernel=kernel)
    num_rows = max((r.query_start + r.q_len for r in requests), default=0)
    gather_blocks = torch.tensor(gather, dtype=torch.int64, device=device)
    if span_kernel is not None:
        return CascadePlan(gather_blocks=gather_blocks, nodes=nodes, node_rows=torch.empty(0),
                           fresh=[], whole=[], merge_rows=torch.empty(0), num_rows=num_rows,
                           private=private,
                           spans=build_span_plan(span_kernel, nodes, whole, private, num_rows))
    merge_rows = [batch.rows for batch in private]
    merge_rows += [node.query_rows for node in nodes for _ in node.spans]
    merge_rows += [torch.arange(start, start + n).to(device) for start, n in fresh]
    return CascadePlan(
        gather_blocks=gather_blocks,
        nodes=nodes,
        node_rows=(torch.cat([node.query_rows for node in nodes]) if nodes
                   else torch.empty(0, dtype=torch.int64, device=device)),
        fresh=fresh,
        whole=whole,
        merge_rows=torch.cat(merge_rows) if merge_rows else torch.empty(0, dtype=torch.int64),
        num_rows=num_rows,
        private=private,
    )


def cascade_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, plan: CascadePlan,
                      scale: float) -> torch.Tensor:
    """Cascade attention over a paged cache the step's K/V were already written to.

    Semantics: the same as the reference ``paged_attention`` without a sliding window:
    every query row attends causally to its request's whole context.
    Shapes: q [T, H, D]; k, v [T, Hkv, D] (this step's fresh K/V); caches
    [num_blocks, block_size, Hkv, D]; returns [T, H, D]. H must be a multiple of Hkv.
    dtypes: float32, bfloat16 or float16, all alike; partial results merge in float32.
    """
    if plan.spans is not None:
        return span_attention(q, k, v, k_cache, v_cache, plan.gather_blocks, plan.private,
                              plan.spans, scale)
    assert _FLASH_CPU is not None
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # [slots, Hkv, D] -> [Hkv, slots, D]: a span is a strided view of these.
    kv_shape = (-1, num_kv_heads, head_dim)
    sources = {
        "cache": (k_cache.view(kv_shape).transpose(0, 1), v_cache.view(kv_shape).transpose(0, 1)),
        "copy": (k_cache.index_select(0, plan.gather_blocks).view(kv_shape).transpose(0, 1),
                 v_cache.index_select(0, plan.gather_blocks).view(kv_shape).transpose(0, 1)),
        "step": (k.transpose(0, 1), v.transpose(0, 1)),
    }
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    parts_out: list[torch.Tensor] = []
    parts_lse: list[torch.Tensor] = []
    for batch in plan.private:
        out, lse = decode_attention(q, k_cache, v_cache, batch, scale)
        assert lse is not None  # a CPU with the flash kernel: cascade_available()
        parts_out.append(out)
        parts_lse.append(lse)
    # Every node's queries gathered at once, with the query heads that share a KV head
    # folded into the query length (one call serves GQA without repeating K/V):
    # [N, H, D] -> [Hkv, N * group, D]; a node's queries are a slice of it.
    q_nodes = (q.index_select(0, plan.node_rows).view(-1, num_kv_heads, group, head_dim)
               .transpose(0, 1).reshape(num_kv_heads, -1, head_dim))
    offset = 0
    for node in plan.nodes:
        width = node.query_rows.numel() * group
        qn = q_nodes[None, :, offset:offset + width]
        offset += width
        for span in node.spans:
            keys = slice(span.start, span.start + span.length)
            k_src, v_src = sources[span.source]
            out, lse = _FLASH_CPU(qn, k_src[:, keys][None], v_src[:, keys][None], 0.0, False,
                                  scale=scale)
            outs.append(out[0])
            lses.append(lse[0])
    # Unfold once: [Hkv, R * group, D] -> [R, H, D] and [Hkv, R * group] -> [R, H].
    if outs:
        parts_out.append(torch.cat(outs, dim=1).view(num_kv_heads, -1, group, head_dim)
                         .transpose(0, 1).reshape(-1, num_heads, head_dim))
        parts_lse.append(torch.cat(lses, dim=1).view(num_kv_heads, -1, group)
                         .transpose(0, 1).reshape(-1, num_heads))
    for first, num in plan.fresh:
        rows = slice(first, first + num)
        qf = q[rows].transpose(0, 1)[None]  # [1, H, rows, D]
        kf = k[rows].transpose(0, 1).repeat_interleave(group, dim=0)[None]
        vf = v[rows].transpose(0, 1).repeat_interleave(group, dim=0)[None]
        out, lse = _FLASH_CPU(qf, kf, vf, 0.0, True, scale=scale)
        parts_out.append(out[0].transpose(0, 1))
        parts_lse.append(lse[0].transpose(0, 1))
    if not plan.nodes and not plan.fresh:
        # Nothing shared and no chunk in pieces: every decode row has its one partial result
        # (its whole context), which is its output; no merge.
        result = q.new_empty(plan.num_rows, num_heads, head_dim)
        for batch, out in zip(plan.private, parts_out, strict=True):
            result.index_copy_(0, batch.rows, out)
    elif parts_out:
        # Rows of whole chunks get no partial result (0 / 0 in the merge): overwritten below.
        result = _merge(torch.cat(parts_out), torch.cat(parts_lse), plan.merge_rows,
                        plan.num_rows, q.dtype)
    else:
        result = q.new_empty(plan.num_rows, num_heads, head_dim)
    for first, num in plan.whole:
        rows = slice(first, first + num)
        # 4-D inputs: torch's CPU SDPA takes its fused kernel only for those.
        result[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
            v[rows].transpose(0, 1)[None], is_causal=True, scale=scale,
            enable_gqa=group > 1)[0].transpose(0, 1)
    return result


def _merge(outs: torch.Tensor, lses: torch.Tensor, rows: torch.Tensor, num_rows: int,
           dtype: torch.dtype) -> torch.Tensor:
    """Softmax over a union of disjoint key sets: each row's partial outputs weighted by
    exp(lse - max lse of that row). outs [R, H, D], lses [R, H] -> [num_rows, H, D]."""
    lses = lses.float()
    num_heads = lses.shape[1]
    peak = torch.full((num_rows, num_heads), float("-inf"), dtype=torch.float32)
    peak.scatter_reduce_(0, rows[:, None].expand(-1, num_heads), lses, "amax")
    weight = torch.exp(lses - peak.index_select(0, rows))
    total = torch.zeros(num_rows, num_heads, dtype=torch.float32).index_add_(0, rows, weight)
    merged = torch.zeros(num_rows, num_heads, outs.shape[2], dtype=torch.float32)
    merged.index_add_(0, rows, outs.float() * weight[..., None])
    return (merged / total[..., None]).to(dtype)
