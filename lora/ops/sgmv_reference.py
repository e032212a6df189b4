"""Torch reference of the segmented LoRA ops: the default path off CUDA and the semantics the
Triton kernels are tested against. Two forms, chosen per call, same results:

- per segment: one matmul per distinct slot; each segment gathers its rows (or slices them
  when they are one contiguous range, as for one long prefill) and writes or adds them back.
  Few ops when a batch holds few slots or long segments.
- grouped: every segment padded to the longest one and done in one batched matmul with the
  slots' weights gathered, so a decode batch spread over many adapters costs a handful of
  ops instead of three per slot (on a CPU, per-op overhead dominates those tiny matmuls).
  Used when there are several segments and padding at most doubles the rows.
Both multiply in the input dtype (torch accumulates low-precision matmuls in fp32).

The model's layers call add_lora_reference, shrink and expand fused: prefill chunks (long
runs of one slot's rows) are sliced in place and only the other rows take the forms above,
gathered once and added back once per projection.
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
    if _grouped(meta):
        s, length = meta.num_segments, meta.max_seg_len
        x_pad = _padded(x, meta).view(s, length, x.shape[1])           # [S, L, H_in]
        a = lora_a.index_select(0, meta.seg_slots)                     # [S, R, H_in]
        t_pad = torch.bmm(x_pad, a.transpose(1, 2)).view(s * length, rank)
        out.index_copy_(0, meta.sorted_token_ids, t_pad.index_select(0, meta.padded_valid))
        return out
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
    if _grouped(meta):
        s, length = meta.num_segments, meta.max_seg_len
        t_pad = _padded(t, meta).view(s, length, t.shape[1])           # [S, L, R]
        b = lora_b.index_select(0, meta.seg_slots)                     # [S, H_out, R]
        y_pad = torch.bmm(t_pad, b.transpose(1, 2)).view(s * length, y.shape[1])
        # index_add_ here: index_put_(accumulate=True) is far slower for many rows on CPU.
        y.index_add_(0, meta.sorted_token_ids, y_pad.index_select(0, meta.padded_valid))
        return
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


def add_lora_reference(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       meta: LoraBatchMetadata, y: torch.Tensor) -> None:
    """Shrink then expand in one pass, the intermediate never scattered to flat rows.

    Semantics: for every LoRA token r of slot s, y[r, :] += (x[r, :] @ lora_a[s].T) @
    lora_b[s].T (exactly expand_reference(shrink_reference(x, ...), ...)); other rows are
    untouched. Runs of many consecutive same-slot rows (prefill chunks) are sliced in place;
    the other rows (decodes) are gathered once, multiplied per slot (or in one grouped batched
    matmul) and scatter-added once: a mixed decode + prefill step over many adapters costs a
    few ops per projection instead of several per slot.
    Shapes: x [T, H_in], lora_a [num_slots, R, H_in], lora_b [num_slots, H_out, R],
    y [T, H_out]. Dtypes: float32, float16 or bfloat16, all the same.
    """
    check_shrink_args(x, lora_a, meta, None)
    # The intermediate t [T, R] is never made; a broadcast stand-in carries its shape.
    check_expand_args(x.new_zeros(1, 1).expand(x.shape[0], lora_a.shape[1]), lora_b, meta, y)
    for run in meta.in_place_runs:
        rows = slice(run.row_start, run.row_start + run.length)
        y[rows].addmm_(x[rows] @ lora_a[run.slot].t(), lora_b[run.slot].t())
    rest = meta if meta.rest is None else meta.rest
    if not rest.num_segments:
        return
    ids = rest.sorted_token_ids
    if _grouped(rest):
        s, length = rest.num_segments, rest.max_seg_len
        x_pad = _padded(x, rest).view(s, length, x.shape[1])              # [S, L, H_in]
        t_pad = torch.bmm(x_pad, lora_a.index_select(0, rest.seg_slots).transpose(1, 2))
        y_pad = torch.bmm(t_pad, lora_b.index_select(0, rest.seg_slots).transpose(1, 2))
        y.index_add_(0, ids, y_pad.view(s * length, -1).index_select(0, rest.padded_valid))
        return
    x_rows = x.index_select(0, ids)                                        # [N, H_in]
    delta = y.new_empty(ids.numel(), y.shape[1])                           # [N, H_out]
    for seg in rest.host_segments:
        rows = slice(seg.start, seg.start + seg.length)
        torch.mm(x_rows[rows] @ lora_a[seg.slot].t(), lora_b[seg.slot].t(), out=delta[rows])
    y.index_add_(0, ids, delta)


GROUPED_MIN_SEGMENTS = 3
GROUPED_MAX_PADDING = 2.0


def _grouped(meta: LoraBatchMetadata) -> bool:
    """Whether the grouped form is the cheaper one for this batch."""
    return (meta.num_segments >= GROUPED_MIN_SEGMENTS
            and meta.padding_ratio <= GROUPED_MAX_PADDING)


def _padded(rows: torch.Tensor, meta: LoraBatchMetadata) -> torch.Tensor:
    """rows laid out as meta.padded_rows says, holes (index T) filled with zeros."""
    extended = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])   # [T + 1, C]
    return extended.index_select(0, meta.padded_rows)                 # [S * L, C]
