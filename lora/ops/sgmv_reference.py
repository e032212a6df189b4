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

from collections.abc import Sequence

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
                       meta: LoraBatchMetadata, y: torch.Tensor,
                       slices: Sequence[int] | None = None) -> None:
    """Shrink then expand in one pass, the intermediate never scattered to flat rows.

    Semantics: for every LoRA token r of slot s, y[r, :] += (x[r, :] @ lora_a[s].T) @
    lora_b[s].T (exactly expand_reference(shrink_reference(x, ...), ...)); other rows are
    untouched. Runs of many consecutive same-slot rows (prefill chunks) are sliced in place;
    the other rows (decodes) are gathered once, multiplied per slot (or in one grouped batched
    matmul) and scatter-added once: a mixed decode + prefill step over many adapters costs a
    few ops per projection instead of several per slot.

    slices (a merged projection, e.g. q/k/v in one GEMM): the output widths (O_0, ..., O_n-1)
    of its n sub-projections, each with its own adapter. lora_a stacks their A's along the
    rank (rows i*R .. (i+1)*R - 1 are sub-projection i's), lora_b their B's along the output
    (rows c_i = O_0 + ... + O_i-1 .. c_i + O_i - 1); then per sub-projection i
        y[r, c_i : c_i + O_i] += (x[r, :] @ lora_a[s, iR : (i+1)R].T) @ lora_b[s, c_i : c_i + O_i].T
    with one shrink for all of them. None: one projection (n = 1).
    Shapes: x [T, H_in], lora_a [num_slots, n*R, H_in], lora_b [num_slots, H_out, R],
    y [T, H_out], H_out = sum(slices). Dtypes: float32, float16 or bfloat16, all the same.
    """
    check_shrink_args(x, lora_a, meta, None)
    plan = slice_plan(slices, lora_a, lora_b)
    # The intermediate t [T, R] is never made; a broadcast stand-in carries its shape.
    check_expand_args(x.new_zeros(1, 1).expand(x.shape[0], lora_b.shape[2]), lora_b, meta, y)
    for run in meta.in_place_runs:
        rows = slice(run.row_start, run.row_start + run.length)
        t = x[rows] @ lora_a[run.slot].t()                                 # [L, n*R]
        for ranks, cols in plan:
            y[rows, cols].addmm_(t[:, ranks], lora_b[run.slot, cols].t())
    rest = meta if meta.rest is None else meta.rest
    if not rest.num_segments:
        return
    ids = rest.sorted_token_ids
    if _grouped(rest):
        s, length = rest.num_segments, rest.max_seg_len
        x_pad = _padded(x, rest).view(s, length, x.shape[1])              # [S, L, H_in]
        t_pad = torch.bmm(x_pad, lora_a.index_select(0, rest.seg_slots).transpose(1, 2))
        b = lora_b.index_select(0, rest.seg_slots).transpose(1, 2)         # [S, R, H_out]
        if len(plan) == 1:
            y_pad = torch.bmm(t_pad, b)                                     # [S, L, H_out]
        else:
            y_pad = torch.cat([torch.bmm(t_pad[:, :, ranks], b[:, :, cols])
                               for ranks, cols in plan], dim=2)
        y.index_add_(0, ids, y_pad.view(s * length, -1).index_select(0, rest.padded_valid))
        return
    x_rows = x.index_select(0, ids)                                        # [N, H_in]
    delta = y.new_empty(ids.numel(), y.shape[1])                           # [N, H_out]
    for seg in rest.host_segments:
        rows = slice(seg.start, seg.start + seg.length)
        t = x_rows[rows] @ lora_a[seg.slot].t()                            # [len, n*R]
        if len(plan) == 1:
            torch.mm(t, lora_b[seg.slot].t(), out=delta[rows])
        else:
            for ranks, cols in plan:
                delta[rows, cols] = t[:, ranks] @ lora_b[seg.slot, cols].t()
    y.index_add_(0, ids, delta)


def slice_plan(slices: Sequence[int] | None, lora_a: torch.Tensor,
               lora_b: torch.Tensor) -> list[tuple[slice, slice]]:
    """(rank columns of t, output columns of y) per sub-projection of a merged projection
    (see add_lora_reference); raises ValueError when the buffers do not fit the slices."""
    out_width, rank = lora_b.shape[1], lora_b.shape[-1]
    widths = [out_width] if slices is None else list(slices)
    if (not widths or any(w < 1 for w in widths) or sum(widths) != out_width
            or lora_a.shape[1] != len(widths) * rank):
        raise ValueError(f"slices {widths} do not fit lora_a {list(lora_a.shape)} and lora_b "
                         f"{list(lora_b.shape)}: need sum(slices) == H_out and "
                         f"lora_a rows == len(slices) * R")
    plan, start = [], 0
    for i, width in enumerate(widths):
        plan.append((slice(i * rank, (i + 1) * rank), slice(start, start + width)))
        start += width
    return plan


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
