"""Paged prefill attention in Triton: the queries of each request's chunk attend to its cached
prefix and, causally, to the chunk itself, all read in place through the block table.

The chunk's own K/V are written to the cache before this runs (engine/attention.py writes
every token's K/V first), so prefix and chunk are one range of cached positions
[0, start_pos + q_len) and a prefix-cache hit costs nothing but its reads. One program per
(query tile, query head): a tile is BLOCK_M consecutive queries of one request, found through
a tile map built on the host (tile -> request, first query), so requests of any lengths share
one launch with no padding between them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton_attention.jit_helpers import (
    check_device,
    default_block_n,
    dot_in_fp32,
    load_kv_tile,
    online_softmax_step,
    pow2_at_least,
    scaled_scores,
)


@triton.jit
def _prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr,
    tile_seq_ptr, tile_first_ptr, query_start_ptr, query_len_ptr, start_pos_ptr,
    scale, softcap, window,
    stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_on, stride_oh,
    PAGE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """Causal attention of one tile of a request's chunk over its cached context.

    Semantics, for tile t of request r = tile_seq[t], queries i in
    [tile_first[t], min(tile_first[t] + BLOCK_M, query_len[r])) at flat row
    query_start[r] + i and position P_i = start_pos[r] + i, query head h, KV head
    h // GROUP:
        keys at positions p <= P_i (and p > P_i - window when USE_WINDOW), where position p
        lives in block block_tables[r, p // PAGE], row p % PAGE;
        out[row_i, h] = softmax_p(scale * q[row_i, h] . k[p]) @ v[p]   (soft-capped scores
        when USE_SOFTCAP).
    Shapes: q, out [T, H, D] (last dim contiguous); caches [num_blocks, PAGE, Hkv, D];
        block_tables [R, W] int32/int64; tile_seq, tile_first [num_tiles] int32;
        query_start, query_len, start_pos [R] int32.
    Dtypes: q, caches, out alike, fp32 / fp16 / bf16; fp32 scores and accumulation.
    Grid: (num_tiles, H).
    """
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    row0 = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_len_ptr + seq)
    pos0 = tl.load(start_pos_ptr + seq)

    offs_m = first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_pos = pos0 + offs_m
    rows = (row0 + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    end = pos0 + tl.minimum(first + BLOCK_M, q_len)     # one past the tile's last query
    start = end * 0
    if USE_WINDOW:
        start = tl.maximum(start, pos0 + first - window + 1)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)
    acc = tl.full((BLOCK_M, HEAD_DIM_PAD), 0.0, dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, offs_n, mask_n, offs_d, mask_d,
                            kv_head, stride_kb, stride_ks, stride_kh,
                            stride_vb, stride_vs, stride_vh, PAGE, DOT_IN_FP32)
        scores = scaled_scores(q, k, scale, softcap, USE_SOFTCAP)      # [BLOCK_M, BLOCK_N]
        allowed = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        # Windowed rows late in the tile, and rows past the chunk, may see no key in a
        # tile: online_softmax_step keeps them finite.
        m_i, l_i, acc = online_softmax_step(tl.where(allowed, scores, float("-inf")), v,
                                            m_i, l_i, acc)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_on + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    block_tables: torch.Tensor, tile_seq: torch.Tensor, tile_first: torch.Tensor,
    query_start: torch.Tensor, query_len: torch.Tensor, start_pos: torch.Tensor, scale: float,
    *, sliding_window: int | None = None, softcap: float | None = None, block_m: int,
    block_n: int | None = None,
) -> None:
    """Every chunk's queries attend causally to their request's cached positions; written
    into ``out`` in place (rows not in any chunk are left alone).

    q, out [T, H, D]; k_cache, v_cache [num_blocks, page, Hkv, D] already holding the chunks'
    own K/V; block_tables [R, W] covering positions [0, start_pos + query_len) of each
    request; tile_seq, tile_first from plan.prefill_tile_map(query_lens, block_m), as int32
    tensors; query_start (flat row of each chunk's first query), query_len, start_pos [R]
    int32. sliding_window, softcap as for paged_decode_attention.
    """
    check_device(_prefill_kernel, q, k_cache, block_tables, tile_seq)
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return
    _prefill_kernel[(num_tiles, num_heads)](
        q, k_cache, v_cache, out, block_tables,
        tile_seq, tile_first, query_start, query_len, start_pos,
        scale, softcap or 1.0, sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        PAGE=page, GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2_at_least(head_dim, 16),
        BLOCK_M=block_m, BLOCK_N=block_n or default_block_n(q.device),
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
        DOT_IN_FP32=dot_in_fp32(_prefill_kernel, q.dtype),
    )
