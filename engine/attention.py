"""Paged attention over a flat batch: metadata built once per step, torch reference backend.

Flat batch layout (T tokens in all), decodes first:

    tokens  [d0 d1 ... d(Nd-1) | p0 chunk ........ | p1 chunk ...... ]
             one query each      query_start[0]     query_start[1]

Each layer's KV cache is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim];
viewed flat as [num_blocks * block_size, ...], token position p of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """One request's prefill chunk: queries at positions [start_pos, start_pos + q_len)."""

    query_start: int
    q_len: int
    start_pos: int
    context_slots: torch.Tensor | None
    """[start_pos + q_len] int64 cache slots of positions 0.., or None when the chunk is
    the whole context (start_pos == 0): then the fresh K/V are used without a gather."""
    mask: torch.Tensor | None
    """[q_len, context_len] bool, True = attend; None means plain causal over fresh K/V."""


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer."""

    slot_mapping: torch.Tensor
    """[T] int64: cache slot each token's K/V is written to."""
    num_decodes: int
    decode_slots: torch.Tensor | None
    """[Nd, L] int64 cache slots of each decode's context, padded to the longest (L)."""
    decode_mask: torch.Tensor | None
    """[Nd, 1, 1, L] bool, True = a real (and in-window) context position."""
    prefills: list[PrefillSeq]


def _slots_for(block_table: list[int], num_positions: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(num_positions)]


def build_attention_metadata(
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[list[int], int, int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> AttentionMetadata:
    """decodes: (block_table, context_len) per one-token request, in batch order.
    prefills: (block_table, start_pos, q_len) per multi-token chunk, after the decodes."""
    slot_mapping: list[int] = []
    num_decodes = len(decodes)
    decode_slots = decode_mask = None
    if decodes:
        max_blocks = max(-(-ctx // block_size) for _, ctx in decodes)
        tables = torch.tensor(
            [bt[:max_blocks] + [0] * (max_blocks - min(len(bt), max_blocks)) for bt, _ in decodes],
            dtype=torch.int64,
        )
        ctx_lens = torch.tensor([ctx for _, ctx in decodes], dtype=torch.int64)
        offsets = torch.arange(block_size, dtype=torch.int64)
        slots = (tables[:, :, None] * block_size + offsets).reshape(num_decodes, -1)
        length = int(ctx_lens.max())
        decode_slots = slots[:, :length].contiguous()
        positions = torch.arange(length, dtype=torch.int64)
        valid = positions[None, :] < ctx_lens[:, None]
        if sliding_window is not None:
            valid &= positions[None, :] > (ctx_lens[:, None] - 1 - sliding_window)
        decode_mask = valid[:, None, None, :]
        slot_mapping.extend(int(s) for s in decode_slots[torch.arange(num_decodes), ctx_lens - 1])
        decode_slots = decode_slots.to(device)
        decode_mask = decode_mask.to(device)

    seqs: list[PrefillSeq] = []
    query_start = num_decodes
    for block_table, start_pos, q_len in prefills:
        ctx_len = start_pos + q_len
        all_slots = _slots_for(block_table, ctx_len, block_size)
        slot_mapping.extend(all_slots[start_pos:])
        fresh = start_pos == 0
        context_slots = None if fresh else torch.tensor(all_slots, dtype=torch.int64,
                                                        device=device)
        mask = None
        if not fresh or sliding_window is not None:
            q_pos = torch.arange(start_pos, ctx_len)[:, None]
            k_pos = torch.arange(ctx_len)[None, :]
            allowed = k_pos <= q_pos
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            mask = allowed.to(device)
        seqs.append(PrefillSeq(query_start, q_len, start_pos, context_slots, mask))
        query_start += q_len

    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        num_decodes=num_decodes,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=seqs,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Torch reference paged attention.

    Semantics: writes k/v of every token into its cache slot, then each token attends
    causally (and within the sliding window, if any) to its request's whole context.
    Shapes: q [T, H, D]; k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D];
    returns [T, H, D]. H must be a multiple of Hkv (GQA). dtypes: q/k/v/caches alike.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    gqa = q.shape[1] != num_kv_heads
    out = torch.empty_like(q)

    nd = meta.num_decodes
    if nd:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        kd = k_flat[meta.decode_slots].transpose(1, 2)  # [Nd, Hkv, L, D]
        vd = v_flat[meta.decode_slots].transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [Nd, H, 1, D]
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )
        out[:nd] = od.squeeze(2)

    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_start + seq.q_len)
        qp = q[rows].transpose(0, 1)  # [H, q_len, D]
        if seq.context_slots is None:
            kp, vp = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [Hkv, q_len, D]
        else:
            kp = k_flat[seq.context_slots].transpose(0, 1)  # [Hkv, ctx, D]
            vp = v_flat[seq.context_slots].transpose(0, 1)
        # A leading batch dim of 1: torch's CPU SDPA takes its fused kernels only for 4-D
        # inputs; 3-D inputs fall back to a path 2-3x slower (measured on torch 2.13).
        op = F.scaled_dot_product_attention(
            qp[None], kp[None], vp[None], attn_mask=seq.mask, is_causal=seq.mask is None,
            scale=scale, enable_gqa=gqa,
        )[0]
        out[rows] = op.transpose(0, 1)
    return out
