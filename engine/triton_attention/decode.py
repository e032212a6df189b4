"""Paged decode attention in Triton: one query per sequence read against its cached context in
place (through its block table), split over the context with a log-sum-exp merge.

A decode step is memory-bound: every cached K/V byte of every sequence is read once per layer
and the arithmetic is tiny. One program per (sequence, KV head, split) loads the G query heads
that share the KV head (GQA) as one [G, D] tile, so each K/V tile is read once for all of
them. Long contexts are cut into splits of ``partition_size`` positions so that a few long
sequences still occupy every multiprocessor; each split writes its partial output and the
log-sum-exp of its scores, and a second kernel merges the splits (the same merge as cascade
attention's). With one split the first kernel writes the output directly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.triton_attention.jit_helpers import (
    LOG2E,
    add_combine,
    check_device,
    default_block_n,
    dot_in_fp32,
    load_kv_tile,
    maximum_combine,
    online_softmax_step,
    pow2_at_least,
    scaled_scores,
)


@triton.jit
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, lse_ptr,
    scale, softcap, window, partition_size,
    stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_on, stride_oh, stride_os,
    stride_ln, stride_lh,
    PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """Attention of one sequence's G query heads over one split of its context.

    Semantics, for sequence n with context length L = context_lens[n], KV head h, split s:
        keys at positions p in [s * partition_size, min((s + 1) * partition_size, L)),
        and p >= L - window when USE_WINDOW; position p lives in cache block
        block_tables[n, p // PAGE], row p % PAGE.
        scores[g, p] = scale * q[n, h * GROUP + g] . k[p]   (soft-capped when USE_SOFTCAP)
        out[n, h * GROUP + g, s] = softmax_p(scores[g]) @ v[p]
        lse[n, h * GROUP + g, s] = logsumexp_p(scores[g])   (-inf for an empty split,
                                                            whose output is zero)
    Shapes: q [N, H, D]; caches [num_blocks, PAGE, Hkv, D] (last dim contiguous);
        block_tables [N, W] int32 or int64; context_lens [N] int32;
        out [N, H, S, D] (any float dtype; S may be 1 with stride 0 to write the final output
        directly); lse [N, H, S] float32 (stride 1 over S). H = Hkv * GROUP.
    Dtypes: q and caches fp32 / fp16 / bf16; fp32 scores, softmax and accumulation.
    Grid: (N, Hkv, S).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, context_len)
    if USE_WINDOW:
        start = tl.maximum(start, context_len - window)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)   # running max, base 2
    l_i = tl.full((GROUP_PAD,), 0.0, dtype=tl.float32)             # running sum of exp2
    acc = tl.full((GROUP_PAD, HEAD_DIM_PAD), 0.0, dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, mask_n, offs_d, mask_d,
                            kv_head, stride_kb, stride_ks, stride_kh,
                            stride_vb, stride_vs, stride_vh, PAGE, DOT_IN_FP32)
        scores = scaled_scores(q, k, scale, softcap, USE_SOFTCAP)            # [G, BLOCK_N]
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc)

    filled = l_i > 0.0
    out = acc / tl.where(filled, l_i, 1.0)[:, None]
    lse = tl.where(filled, (m_i + tl.log2(tl.where(filled, l_i, 1.0))) / LOG2E, float("-inf"))
    tl.store(out_ptr + seq * stride_on + heads[:, None] * stride_oh + split * stride_os
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_g[:, None] & mask_d[None, :])
    tl.store(lse_ptr + seq * stride_ln + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    part_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits,
    stride_pn, stride_ph, stride_ps,
    stride_qn, stride_qh,
    stride_on, stride_oh,
    stride_ln, stride_lh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Merge the splits of one (sequence, query head).

    Semantics: w[s] = exp(part_lse[n, h, s] - max_s part_lse[n, h, s]);
        out[n, h] = sum_s w[s] * part[n, h, s] / sum_s w[s];
        lse[n, h] = max + log(sum_s w[s]).
    Shapes: part [N, H, S, D] float32, part_lse [N, H, S] float32 (strides stride_q*, 1),
        out [N, H, D] in the query dtype, lse [N, H] float32. Grid: (N, H).
    Every sequence has a non-empty first split, so the max is finite.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    part_lse = tl.load(part_lse_ptr + seq * stride_qn + head * stride_qh + offs_s,
                       mask=mask_s, other=float("-inf"))
    top = tl.reduce(part_lse, 0, maximum_combine)
    weights = tl.exp(part_lse - top)
    total = tl.reduce(weights, 0, add_combine)
    part = tl.load(part_ptr + seq * stride_pn + head * stride_ph + offs_s[:, None] * stride_ps
                   + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.reduce(part * weights[:, None], 0, add_combine) / total
    tl.store(out_ptr + seq * stride_on + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)
    tl.store(lse_ptr + seq * stride_ln + head * stride_lh, top + tl.log(total))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's SM count (asked once: the eager path plans a split per layer call)."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def decode_partition_size(max_context: int, num_seqs: int, num_kv_heads: int,
                          device: torch.device, block_n: int) -> int:
    """Positions per split: one split when (sequences x KV heads) already gives every
    multiprocessor about four programs, else enough splits for that, but none under 256
    positions (a shorter split costs more in its merge than it saves). A multiple of block_n."""
    programs = num_seqs * num_kv_heads
    wanted = 4 * _multiprocessors(device) if device.type == "cuda" else programs
    splits = max(1, -(-wanted // max(programs, 1)))
    size = max(256, -(-max_context // splits))
    return -(-size // block_n) * block_n


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, max_context: int, scale: float,
    *, sliding_window: int | None = None, softcap: float | None = None,
    partition_size: int | None = None, out: torch.Tensor | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's single query attends to its cached context (positions 0..L-1).

    q [N, H, D] (rows may be a strided view); k_cache, v_cache [num_blocks, page, Hkv, D];
    block_tables [N, W] int32/int64 with W >= ceil(L / page); context_lens [N] int32 with
    every L >= 1; max_context >= every L (a host-side int, so no device sync).
    sliding_window: attend to the last that many positions. softcap: Gemma 2's soft-capping.
    partition_size: positions per split (default: decode_partition_size); out: [N, H, D] to
    write into. Returns (out, lse [N, H] float32: the log-sum-exp of each row's scaled
    scores, which cascade attention merges with).
    """
    check_device(_decode_split_kernel, q, k_cache, block_tables, context_lens)
    n, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    if context_lens.stride(0) != 1 or block_tables.stride(1) != 1:
        raise ValueError("context_lens and the rows of block_tables must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    if n == 0:
        return out, torch.empty(0, num_heads, dtype=torch.float32, device=q.device)
    block_n = block_n or default_block_n(q.device)
    size = partition_size or decode_partition_size(max_context, n, num_kv_heads, q.device,
                                                   block_n)
    splits = max(1, -(-max_context // size))
    group = num_heads // num_kv_heads
    if splits == 1:
        part, part_stride_s = out, 0
    else:
        part = torch.empty(n, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_stride_s = part.stride(2)
    part_lse = torch.empty(n, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(n, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, part, part_lse,
        scale, softcap or 1.0, sliding_window or 0, size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        part.stride(0), part.stride(1), part_stride_s,
        part_lse.stride(0), part_lse.stride(1),
        PAGE=page, GROUP=group, GROUP_PAD=pow2_at_least(group, 16),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2_at_least(head_dim, 16), BLOCK_N=block_n,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
        DOT_IN_FP32=dot_in_fp32(_decode_split_kernel, q.dtype),
    )
    if splits == 1:
        return out, part_lse[:, :, 0]
    lse = torch.empty(n, num_heads, dtype=torch.float32, device=q.device)
    _merge_splits_kernel[(n, num_heads)](
        part, part_lse, out, lse, splits,
        part.stride(0), part.stride(1), part.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2_at_least(head_dim, 16),
        SPLITS_PAD=pow2_at_least(splits, 2),
    )
    return out, lse
