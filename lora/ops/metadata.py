"""Per-step LoRA batch metadata: the flat batch's tokens grouped into one segment per slot.

The runner builds one LoraBatchMetadata per step from the slot of every flat-batch token
(-1: no adapter) and every LoRA op of every layer reads it. Tokens are grouped by slot with
a stable sort, so within a segment rows keep their flat-batch order:

    token_slots       = [ 2  2 -1  0  0  0  2  1 ]      flat row t -> slot (-1: base only)
    sorted_token_ids  = [ 3  4  5 | 7 | 0  1  6 ]       rows of slot 0 | slot 1 | slot 2
    seg_starts        = [ 0       , 3 , 4       ]       offsets into sorted_token_ids
    seg_lens          = [ 3       , 1 , 3       ]
    seg_slots         = [ 0       , 1 , 2       ]

Tokens with slot -1 are in no segment, so a request without an adapter costs nothing.

For the torch path's grouped (batched-matmul) form, segments are also laid out padded to
the longest one, segment-major, with the dummy row T (a zero row appended by the op) in the
holes; with the example (T = 8, longest segment 3):

    padded_rows       = [ 3  4  5 | 7  8  8 | 0  1  6 ]   [S * max_seg_len] rows into x_ext
    padded_valid      = [ 0  1  2 | 3 |       6  7  8 ]   positions of real rows, in the
                                                          order of sorted_token_ids

For the torch path's fused op (shrink and expand in one pass), runs of at least
IN_PLACE_MIN_ROWS consecutive rows of one slot (a prefill chunk) are listed in
`in_place_runs`, to be sliced in place; `rest` is the metadata of the other rows (decodes,
short chunks) alone, built by the same function with the runs' rows taken out.

The device arrays travel in one host-to-device copy; `host_segments` mirrors them on the host
so the torch path and the launchers never read a device tensor back (no sync per layer).
This module also holds the argument checks shared by the torch and Triton paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

IN_PLACE_MIN_ROWS = 16
"""Shortest run of consecutive same-slot rows the fused torch path slices in place rather
than gathers (a gather and scatter-add of a few rows costs less than two more matmul calls)."""


@dataclass(frozen=True, slots=True)
class HostSegment:
    """Host-side copy of one segment.

    `row_start` is the flat row of the segment's first token; when `contiguous` is true the
    segment's rows are exactly row_start .. row_start + length - 1, so a path may slice
    instead of gather.
    """

    slot: int
    start: int
    length: int
    row_start: int
    contiguous: bool


@dataclass(frozen=True, slots=True)
class LoraBatchMetadata:
    """Tokens of one flat batch grouped by LoRA slot; built once per step, read by every op.

    Device tensors (int64, on the batch's device):
        sorted_token_ids: [num_lora_tokens]  flat rows grouped by slot, ascending within a slot
        seg_starts:       [num_segments]     segment i is sorted_token_ids[seg_starts[i] :
        seg_lens:         [num_segments]         seg_starts[i] + seg_lens[i]]
        seg_slots:        [num_segments]     slot of segment i (distinct, ascending)
    Host values:
        num_tokens:       T, rows of the flat batch (LoRA and base-only tokens)
        num_lora_tokens:  tokens with an adapter (sum of seg_lens)
        num_segments:     distinct slots in the batch; 0 makes every op a no-op
        max_seg_len:      longest segment (sizes the kernels' row-tile grid)
        host_segments:    the segments again, as Python ints
    Grouped layout (device, int64; see the module docstring):
        padded_rows:      [num_segments * max_seg_len]
        padded_valid:     [num_lora_tokens]
    Fused torch path (see the module docstring):
        in_place_runs:    runs of >= IN_PLACE_MIN_ROWS consecutive rows of one slot
                          (``start`` is -1: they are addressed by row only)
        rest:             metadata of every other LoRA row; None when there is no run
                          (then the rest is this metadata itself)
    """

    sorted_token_ids: torch.Tensor
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor
    num_tokens: int
    num_lora_tokens: int
    num_segments: int
    max_seg_len: int
    host_segments: tuple[HostSegment, ...]
    padded_rows: torch.Tensor
    padded_valid: torch.Tensor
    in_place_runs: tuple[HostSegment, ...] = ()
    rest: LoraBatchMetadata | None = None

    @property
    def padding_ratio(self) -> float:
        """Rows of the grouped layout per real LoRA row (1.0: no padding)."""
        return self.num_segments * self.max_seg_len / max(1, self.num_lora_tokens)

    @property
    def device(self) -> torch.device:
        """Device of the segment arrays (must match the activations)."""
        return self.sorted_token_ids.device

    @property
    def max_slot(self) -> int:
        """Largest slot referenced by the batch, -1 when no token has an adapter."""
        return self.host_segments[-1].slot if self.host_segments else -1


def build_lora_metadata(
    token_slots: Sequence[int] | torch.Tensor, device: torch.device | str,
    find_runs: bool = True,
) -> LoraBatchMetadata:
    """Group the flat batch's tokens by adapter slot.

    token_slots[t] is the slot of flat-batch token t, or -1 for no adapter. Tokens of one
    request are contiguous but the batch need not be sorted by slot. Raises ValueError for
    a non-1-D or non-integer input or a slot below -1. find_runs: also list the long runs
    and the rest's metadata (the fused torch path's layout).
    """
    if isinstance(token_slots, torch.Tensor):
        if token_slots.dtype.is_floating_point or token_slots.dtype == torch.bool:
            raise ValueError(f"token_slots must be an integer tensor, got {token_slots.dtype}")
        slots = token_slots.detach().to("cpu", torch.int64)
    else:
        slots = torch.as_tensor(list(token_slots), dtype=torch.int64)
    if slots.ndim != 1:
        raise ValueError(f"token_slots must be 1-D, got shape {tuple(slots.shape)}")
    if slots.numel() and int(slots.min()) < -1:
        raise ValueError(f"token_slots must be >= -1 (-1: no adapter), got {int(slots.min())}")

    lora_rows = torch.nonzero(slots >= 0).squeeze(1)                  # [N] ascending
    order = torch.argsort(slots[lora_rows], stable=True)
    sorted_ids = lora_rows[order]                                      # [N]
    seg_slots, seg_lens = torch.unique_consecutive(slots[sorted_ids], return_counts=True)
    seg_starts = torch.cumsum(seg_lens, 0) - seg_lens                  # [S]

    # Rows are ascending within a segment: it is one contiguous row range iff
    # last_row - first_row == length - 1.
    first_rows = sorted_ids[seg_starts]
    last_rows = sorted_ids[seg_starts + seg_lens - 1]
    contiguous = (last_rows - first_rows) == (seg_lens - 1)
    host_segments = tuple(
        HostSegment(slot, start, length, row, is_contig)
        for slot, start, length, row, is_contig in zip(
            seg_slots.tolist(), seg_starts.tolist(), seg_lens.tolist(), first_rows.tolist(),
            contiguous.tolist(), strict=True,
        )
    )

    # Grouped layout: real row k (segment i, offset j) sits at padded position i * L + j.
    n, s = sorted_ids.numel(), seg_slots.numel()
    max_len = int(seg_lens.max()) if s else 0
    seg_of_row = torch.repeat_interleave(torch.arange(s), seg_lens)           # [N]
    offset_in_seg = torch.arange(n) - seg_starts[seg_of_row]                 # [N]
    padded_valid = seg_of_row * max_len + offset_in_seg                      # [N]
    padded_rows = torch.full((s * max_len,), slots.numel(), dtype=torch.int64)
    padded_rows[padded_valid] = sorted_ids

    in_place_runs: tuple[HostSegment, ...] = ()
    rest = None
    if find_runs and n >= IN_PLACE_MIN_ROWS:
        # A run breaks where the slot changes or the next sorted row is not the next row.
        sorted_slots = slots[sorted_ids]
        breaks = torch.ones(n, dtype=torch.bool)
        breaks[1:] = (sorted_slots[1:] != sorted_slots[:-1]) | (sorted_ids[1:]
                                                                != sorted_ids[:-1] + 1)
        run_starts = torch.nonzero(breaks).squeeze(1)
        run_lens = torch.diff(run_starts, append=torch.tensor([n]))
        long = run_lens >= IN_PLACE_MIN_ROWS
        if bool(long.any()):
            firsts = sorted_ids[run_starts[long]]
            in_place_runs = tuple(
                HostSegment(slot, -1, length, row, True) for slot, length, row in zip(
                    sorted_slots[run_starts[long]].tolist(), run_lens[long].tolist(),
                    firsts.tolist(), strict=True))
            rest_slots = slots.clone()
            for run in in_place_runs:
                rest_slots[run.row_start:run.row_start + run.length] = -1
            rest = build_lora_metadata(rest_slots, device, find_runs=False)

    # One transfer for all arrays, then views into it.
    packed = torch.cat([sorted_ids, seg_starts, seg_lens, seg_slots, padded_valid,
                        padded_rows]).to(device)
    return LoraBatchMetadata(
        sorted_token_ids=packed[:n],
        seg_starts=packed[n:n + s],
        seg_lens=packed[n + s:n + 2 * s],
        seg_slots=packed[n + 2 * s:n + 3 * s],
        num_tokens=slots.numel(),
        num_lora_tokens=n,
        num_segments=s,
        max_seg_len=max_len,
        host_segments=host_segments,
        padded_valid=packed[n + 3 * s:2 * n + 3 * s],
        padded_rows=packed[2 * n + 3 * s:],
        in_place_runs=in_place_runs,
        rest=rest,
    )


def _check_2d(name: str, tensor: torch.Tensor, rows: int, cols: int | None = None) -> None:
    if tensor.ndim != 2 or tensor.shape[0] != rows or (cols is not None
                                                       and tensor.shape[1] != cols):
        want = f"[{rows}, {cols if cols is not None else '*'}]"
        raise ValueError(f"{name} must have shape {want}, got {list(tensor.shape)}")


def _check_common(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...],
                  meta: LoraBatchMetadata) -> None:
    dtype, device = tensors[0].dtype, tensors[0].device
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{names[0]} dtype must be float32, float16 or bfloat16, got {dtype}")
    for name, tensor in zip(names[1:], tensors[1:], strict=True):
        if tensor.dtype != dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} does not match {names[0]} {dtype}")
    for name, tensor in zip(names, tensors, strict=True):
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, {names[0]} on {device}")
    if meta.device != device:
        raise ValueError(f"LoRA metadata is on {meta.device}, {names[0]} on {device}")


def check_shrink_args(x: torch.Tensor, lora_a: torch.Tensor, meta: LoraBatchMetadata,
                      out: torch.Tensor | None) -> None:
    """Validate shrink's arguments (shapes, dtypes, devices, slots); raise ValueError."""
    _check_2d("x", x, meta.num_tokens)
    if lora_a.ndim != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a must have shape [num_slots, R, {x.shape[1]}] (H_in of x), "
                         f"got {list(lora_a.shape)}")
    if lora_a.shape[0] <= meta.max_slot:
        raise ValueError(f"batch uses slot {meta.max_slot} but lora_a has only "
                         f"{lora_a.shape[0]} slots")
    names: tuple[str, ...] = ("x", "lora_a")
    tensors: tuple[torch.Tensor, ...] = (x, lora_a)
    if out is not None:
        _check_2d("out", out, meta.num_tokens, lora_a.shape[1])
        names, tensors = (*names, "out"), (*tensors, out)
    _check_common(names, tensors, meta)


def check_expand_args(t: torch.Tensor, lora_b: torch.Tensor, meta: LoraBatchMetadata,
                      y: torch.Tensor) -> None:
    """Validate expand's arguments (shapes, dtypes, devices, slots); raise ValueError."""
    _check_2d("t", t, meta.num_tokens)
    if lora_b.ndim != 3 or lora_b.shape[2] != t.shape[1]:
        raise ValueError(f"lora_b must have shape [num_slots, H_out, {t.shape[1]}] (R of t), "
                         f"got {list(lora_b.shape)}")
    if lora_b.shape[0] <= meta.max_slot:
        raise ValueError(f"batch uses slot {meta.max_slot} but lora_b has only "
                         f"{lora_b.shape[0]} slots")
    _check_2d("y", y, meta.num_tokens, lora_b.shape[1])
    _check_common(("t", "lora_b", "y"), (t, lora_b, y), meta)
