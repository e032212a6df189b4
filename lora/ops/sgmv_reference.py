"""Torch reference of the segmented LoRA ops: one matmul per distinct slot in the batch.

This is the default path off CUDA and the semantics the Triton kernels are tested against.
A batch holds few distinct slots (at most max_loras), so looping over segments is cheap:
each segment gathers its rows (or slices them when they are one contiguous range, the
common case of a single request or a batch sorted by adapter), does one matmul in the input
dtype (torch accumulates low-precision matmuls in fp32) and writes or adds the rows back.
"""

from __future__ import annotations

import torch

from lora.ops.metadata import LoraBatchMetadata, check_expand_args, check_shrink_args


def shrink_reference(x: torch.Tensor, lora_a: torch.Tensor, meta: LoraBatchMetadata,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """LoRA down-projection of every token through its slot's A.

    Semantics:
        for segment i with slot s = seg_slots[i], for every row r in
        sorted_token_ids[seg_starts[i] : seg_starts[i] + seg_lens[i]]:
            out[r, :] = x[r, :] @ lora_a[s].T
        rows of tokens without an adapter are zero.
    Shapes: x [T, H_in], lora_a [num_slots, R, H_in], out [T, R] (allocated when None).
    Dtypes: float32, float16 or bfloat16, all the same.
    """
    check_shrink_args(x, lora_a, meta, out)
    rank = lora_a.shape[1]
    if out is None:
        out = x.new_zeros(meta.num_tokens, rank)                       # [T, R]
    elif meta.num_lora_tokens < meta.num_tokens:
        out.zero_()
    for seg in meta.host_segments:
        a_t = lora_a[seg.slot].t()                                     # [H_in, R]
        if seg.contiguous:
            rows = slice(seg.row_start, seg.row_start + seg.length)
            torch.matmul(x[rows], a_t, out=out[rows])
        else:
            ids = meta.sorted_token_ids[seg.start:seg.start + seg.length]
            out.index_copy_(0, ids, x.index_select(0, ids) @ a_t)
    return out


def expand_reference(t: torch.Tensor, lora_b: torch.Tensor, meta: LoraBatchMetadata,
                     y: torch.Tensor) -> None:
    """LoRA up-projection of every token through its slot's B, added to y in place.

    Semantics:
        for segment i with slot s = seg_slots[i], for every row r in
        sorted_token_ids[seg_starts[i] : seg_starts[i] + seg_lens[i]]:
            y[r, :] += t[r, :] @ lora_b[s].T
        rows of tokens without an adapter are untouched.
    Shapes: t [T, R], lora_b [num_slots, H_out, R], y [T, H_out].
    Dtypes: float32, float16 or bfloat16, all the same. Scaling is pre-folded into lora_b.
    """
    check_expand_args(t, lora_b, meta, y)
    for seg in meta.host_segments:
        b_t = lora_b[seg.slot].t()                                     # [R, H_out]
        if seg.contiguous:
            rows = slice(seg.row_start, seg.row_start + seg.length)
            y[rows].addmm_(t[rows], b_t)
        else:
            ids = meta.sorted_token_ids[seg.start:seg.start + seg.length]
            # index_put_ over index_add_: same result (ids are distinct), far less overhead
            # for small row counts on CPU.
            y.index_put_((ids,), t.index_select(0, ids) @ b_t, accumulate=True)
