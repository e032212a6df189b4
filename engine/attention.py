"""Paged attention over a flat batch: metadata built once per step, torch reference backend.

Flat batch layout (T tokens in all), decodes first:

    tokens  [d0 d1 ... d(Nd-1) | p0 chunk ........ | p1 chunk ...... ]
             one query each      query_start[0]     query_start[1]

Each layer's KV cache is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim];
viewed flat as [num_blocks * block_size, ...], token position p of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Layers may differ in their sliding window (Gemma: local and global layers): a step builds
one AttentionMetadata per distinct window of the model (build_step_metadata), all sharing
one slot mapping, and each layer reads the one of its own window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from engine.cascade_attention import (
    CascadePlan,
    CascadeRequest,
    build_cascade_plan,
    cascade_attention,
    cascade_available,
)
from engine.cpu_kernels import PagedDecodeOp, SpanAttentionOp
from engine.paged_decode import CopyBuffers, DecodeBatch, build_decode_batches, decode_attention
from engine.triton_attention import TritonAttentionPlan, build_triton_plan, triton_attention

BlockTable = Sequence[int] | npt.NDArray[np.int64]
"""A request's cache blocks in position order: a list, or a row of the runner's array."""


@dataclass
class PrefillSeq:
    """One request's prefill chunk: queries at positions [start_pos, start_pos + q_len)."""

    query_start: int
    q_len: int
    start_pos: int
    context_blocks: torch.Tensor | None
    """[ceil((start_pos + q_len) / block_size)] int64 cache blocks holding positions 0..,
    or None when the chunk is the whole context (start_pos == 0): then the fresh K/V are
    used without a gather."""
    mask: torch.Tensor | None
    """[q_len, context_len] bool, True = attend; None means plain causal over fresh K/V."""


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer."""

    slot_mapping: torch.Tensor
    """[T] int64: cache slot each token's K/V is written to."""
    num_decodes: int
    decodes: list[DecodeBatch]
    """The step's decodes (rows 0..num_decodes-1) as attention calls of similar lengths."""
    prefills: list[PrefillSeq]
    cascade: CascadePlan | None = None
    """Set when the step runs cascade attention instead (then the fields above that only
    the reference path reads are left empty)."""
    triton: TritonAttentionPlan | None = None
    """Set when the step runs the Triton kernels (engine/triton_attention); likewise."""


def build_step_metadata(
    decodes: Sequence[tuple[BlockTable, int]],
    prefills: Sequence[tuple[BlockTable, int, int]],
    block_size: int,
    windows: Iterable[int | None],
    device: torch.device,
    cascade: bool = False,
    buffers: CopyBuffers | None = None,
    kernel: PagedDecodeOp | None = None,
    triton_block_m: int | None = None,
    span_kernel: SpanAttentionOp | None = None,
) -> dict[int | None, AttentionMetadata]:
    """The step's metadata for each distinct sliding window (None: full attention) among
    the model's layers, all with one shared slot mapping. Arguments as for
    build_attention_metadata; only the full-attention entry may plan cascade attention.
    triton_block_m: run the Triton kernels (engine/triton_attention) with prefill tiles of
    that many queries instead of the torch path; one plan then serves every window."""
    slot_mapping = _slot_mapping(decodes, prefills, block_size, device)
    if triton_block_m is not None:
        plan = build_triton_plan(decodes, prefills, block_size, None, device, triton_block_m)
        return {window: AttentionMetadata(slot_mapping=slot_mapping, num_decodes=len(decodes),
                                          decodes=[], prefills=[],
                                          triton=plan.with_window(window))
                for window in dict.fromkeys(windows)}
    return {window: build_attention_metadata(decodes, prefills, block_size, window, device,
                                             cascade, slot_mapping, buffers, kernel,
                                             span_kernel)
            for window in dict.fromkeys(windows)}


def build_attention_metadata(
    decodes: Sequence[tuple[BlockTable, int]],
    prefills: Sequence[tuple[BlockTable, int, int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    cascade: bool = False,
    slot_mapping: torch.Tensor | None = None,
    buffers: CopyBuffers | None = None,
    kernel: PagedDecodeOp | None = None,
    span_kernel: SpanAttentionOp | None = None,
) -> AttentionMetadata:
    """decodes: (block_table, context_len) per one-token request, in batch order.
    prefills: (block_table, start_pos, q_len) per multi-token chunk, after the decodes.
    cascade: plan cascade attention when the device and model allow it.
    slot_mapping: the step's, when already built (for another window).
    buffers: the engine's space for the decodes' K/V copies (engine/paged_decode.py).
    kernel: the compiled decode kernel (engine/cpu_kernels), which needs no copies.
    span_kernel: the compiled span kernel for cascade attention (float32 caches only)."""
    if slot_mapping is None:
        slot_mapping = _slot_mapping(decodes, prefills, block_size, device)
    if cascade and sliding_window is None and cascade_available(device):
        return _cascade_metadata(decodes, prefills, block_size, slot_mapping, device, buffers,
                                 kernel, span_kernel)
    num_decodes = len(decodes)
    decode_batches = build_decode_batches(
        [(row, bt, ctx) for row, (bt, ctx) in enumerate(decodes)], block_size, device,
        sliding_window, buffers, kernel)

    seqs: list[PrefillSeq] = []
    query_start = num_decodes
    for block_table, start_pos, q_len in prefills:
        ctx_len = start_pos + q_len
        fresh = start_pos == 0
        context_blocks = None if fresh else torch.tensor(
            block_table[:-(-ctx_len // block_size)], dtype=torch.int64, device=device)
        mask = None
        if not fresh or sliding_window is not None:
            q_pos = torch.arange(start_pos, ctx_len)[:, None]
            k_pos = torch.arange(ctx_len)[None, :]
            allowed = k_pos <= q_pos
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            mask = allowed.to(device)
        seqs.append(PrefillSeq(query_start, q_len, start_pos, context_blocks, mask))
        query_start += q_len

    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decodes=num_decodes,
        decodes=decode_batches,
        prefills=seqs,
    )


def _slot_mapping(
    decodes: Sequence[tuple[BlockTable, int]],
    prefills: Sequence[tuple[BlockTable, int, int]],
    block_size: int,
    device: torch.device,
) -> torch.Tensor:
    """[T] cache slot of each token of the step, in batch order (decodes, then chunks)."""
    slots = [int(bt[(ctx - 1) // block_size]) * block_size + (ctx - 1) % block_size
             for bt, ctx in decodes]
    parts = [np.array(slots, dtype=np.int64)]
    for bt, start_pos, q_len in prefills:
        positions = np.arange(start_pos, start_pos + q_len)
        table = np.asarray(bt[:-(-(start_pos + q_len) // block_size)], dtype=np.int64)
        parts.append(table[positions // block_size] * block_size + positions % block_size)
    return torch.from_numpy(np.concatenate(parts)).to(device)


def _as_list(block_table: BlockTable) -> list[int]:
    return block_table.tolist() if isinstance(block_table, np.ndarray) else list(block_table)


def _cascade_metadata(
    decodes: Sequence[tuple[BlockTable, int]],
    prefills: Sequence[tuple[BlockTable, int, int]],
    block_size: int,
    slot_mapping: torch.Tensor,
    device: torch.device,
    buffers: CopyBuffers | None,
    kernel: PagedDecodeOp | None,
    span_kernel: SpanAttentionOp | None,
) -> AttentionMetadata:
    requests = [CascadeRequest(_as_list(block_table), ctx, row, 1, fresh=False)
                for row, (block_table, ctx) in enumerate(decodes)]
    query_start = len(decodes)
    for block_table, start_pos, q_len in prefills:
        requests.append(CascadeRequest(_as_list(block_table), start_pos, query_start, q_len,
                                       fresh=True))
        query_start += q_len
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decodes=len(decodes), decodes=[],
        prefills=[], cascade=build_cascade_plan(requests, block_size, device,
                                                buffers=buffers, kernel=kernel,
                                                span_kernel=span_kernel),
    )


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Whole blocks copied out of the cache (one contiguous copy per block, far cheaper
    than a per-position gather), viewed as positions: blocks [..., B] ->
    [..., length, Hkv, D]."""
    gathered = cache.index_select(0, blocks.reshape(-1))
    return gathered.view(*blocks.shape[:-1], -1, *cache.shape[2:])[..., :length, :, :]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Torch reference paged attention (or cascade attention, or the Triton kernels, when
    the metadata planned them).

    Semantics: writes k/v of every token into its cache slot, then each token attends
    causally (and within the sliding window, if any) to its request's whole context.
    softcap (Gemma 2): scores = softcap * tanh(scale * q.k / softcap) before the mask;
    the cascade path has no soft-capping, so a model with one never plans it.
    Shapes: q [T, H, D]; k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D];
    returns [T, H, D]. H must be a multiple of Hkv (GQA). dtypes: q/k/v/caches alike.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    if meta.triton is not None:
        return triton_attention(q, k_cache, v_cache, meta.triton, scale, softcap)
    if meta.cascade is not None:
        assert softcap is None, "cascade attention has no soft-capping"
        return cascade_attention(q, k, v, k_cache, v_cache, meta.cascade, scale)
    gqa = q.shape[1] != num_kv_heads
    out = torch.empty_like(q)

    for batch in meta.decodes:
        out.index_copy_(0, batch.rows, decode_attention(q, k_cache, v_cache, batch, scale,
                                                        softcap)[0])

    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_start + seq.q_len)
        qp = q[rows].transpose(0, 1)  # [H, q_len, D]
        if seq.context_blocks is None:
            kp, vp = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [Hkv, q_len, D]
        else:
            ctx_len = seq.start_pos + seq.q_len
            kp = _gather_context(k_cache, seq.context_blocks, ctx_len).transpose(0, 1)
            vp = _gather_context(v_cache, seq.context_blocks, ctx_len).transpose(0, 1)
        # A leading batch dim of 1: torch's CPU SDPA takes its fused kernels only for 4-D
        # inputs; 3-D inputs fall back to a path 2-3x slower (measured on torch 2.13).
        op = _attend(qp[None], kp[None], vp[None], seq.mask, scale, softcap, gqa)[0]
        out[rows] = op.transpose(0, 1)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float | None, gqa: bool) -> torch.Tensor:
    """softmax(scale * q @ k.T, masked) @ v. q [B, H, Lq, D], k/v [B, Hkv, Lk, D], mask
    broadcastable to [B, H, Lq, Lk] (True = attend) or None for causal with Lq == Lk.
    With softcap the scores are capped first (Gemma 2), in explicit matmuls since torch's
    SDPA has no such option; the softmax then runs in fp32, as transformers' does."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
