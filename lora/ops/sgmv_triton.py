"""Punica-style segmented gather matrix-vector (SGMV) LoRA kernels in Triton.

Two kernels apply many adapters to one flat batch in a single launch each:

    shrink:  t[r] = x[r] @ A[s].T       x [T, H_in] -> t [T, R]       (R small)
    expand:  y[r] += t[r] @ B[s].T      t [T, R]    -> y [T, H_out]

for every token row r in a segment of slot s (see lora.ops.metadata). Both grids are
(segment, row tile of max_seg_len, output column tile); row tiles past the end of a short
segment exit at once. A row belongs to exactly one segment, so every output element has one
writer and no atomics are needed. Rows are gathered through sorted_token_ids, so the batch
never has to be permuted.

Kernels are decorated at import: with TRITON_INTERPRET=1 in the environment at that moment
they run in Triton's CPU interpreter (tests on machines without a GPU); otherwise they
compile for the GPU and need CUDA tensors. The kernels call only triton.language builtins, not
its @triton.jit helpers (tl.zeros, tl.cdiv): those are decorated when triton itself is
imported, and an interpreted kernel cannot call a compiled helper, so avoiding them lets the
interpreter work even when triton was imported before TRITON_INTERPRET was set.
"""

from functools import cache

import torch
import triton
import triton.language as tl

from lora.ops.metadata import LoraBatchMetadata, check_expand_args, check_shrink_args


@triton.jit
def _sgmv_shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr, a_ptr, out_ptr,
    sorted_ids_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    H_in, R, N_TILES, K_TILES, TILES_PER_SPLIT,
    stride_xm, stride_as, stride_ar, stride_os, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """SGMV shrink: LoRA down-projection, one program per (segment, row tile, rank tile,
    split of H_in).

    Semantics:
        for segment i with slot s = seg_slots[i], for every row r in
        sorted_token_ids[seg_starts[i] : seg_starts[i] + seg_lens[i]], and every split k:
            out[k, r, :] = x[r, H_k] @ lora_a[s][:, H_k].T
        where H_k is the k-th run of TILES_PER_SPLIT tiles of BLOCK_K columns of H_in (the
        last run may be shorter). With one split (stride_os unused) out is the result;
        with several, out is an fp32 buffer the caller sums over k.
    Shapes: x [T, H_in], lora_a [num_slots, R, H_in], out [splits, T, R] (or [T, R] with
        one split); inner dims stride 1. sorted_ids [num_lora_tokens], seg_*
        [num_segments], all int64. K_TILES = cdiv(H_in, BLOCK_K), N_TILES = cdiv(R, BLOCK_N).
    Dtypes: x, lora_a one of fp32 / fp16 / bf16; fp32 accumulation over H_in in BLOCK_K
        tiles; stored in out's dtype.
    Grid: (num_segments, cdiv(max_seg_len, BLOCK_M), N_TILES * splits).
    DOT_IN_FP32 upcasts the tiles before tl.dot (set only for bf16 in the interpreter).
    """
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2) % N_TILES
    pid_k = tl.program_id(2) // N_TILES
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                  # [BM] within segment
    mask_m = offs_m < seg_len
    rows = tl.load(sorted_ids_ptr + seg_start + offs_m, mask=mask_m, other=0)  # [BM] int64
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                  # [BN] rank columns
    mask_n = offs_n < R
    k_begin = pid_k * TILES_PER_SPLIT                                  # first K tile
    k_end = tl.minimum(k_begin + TILES_PER_SPLIT, K_TILES)
    first_col = k_begin * BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)                                     # [BK] within a tile

    x_ptrs = x_ptr + rows[:, None] * stride_xm + first_col + offs_k[None, :]      # [BM, BK]
    a_ptrs = (a_ptr + slot * stride_as + offs_n[None, :] * stride_ar
              + first_col + offs_k[:, None])                                      # [BK, BN]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k in range(k_begin, k_end):
        k_left = H_in - k * BLOCK_K
        x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        a_tile = tl.load(a_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if DOT_IN_FP32:
            x_tile = x_tile.to(tl.float32)
            a_tile = a_tile.to(tl.float32)
        # "ieee": exact fp32 products for fp32 inputs (tf32 would miss the reference);
        # ignored for fp16 / bf16.
        acc = tl.dot(x_tile, a_tile, acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K

    out_ptrs = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _sgmv_expand_kernel(  # type: ignore[no-untyped-def]
    t_ptr, b_ptr, y_ptr,
    sorted_ids_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    R, H_out,
    stride_tm, stride_bs, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """SGMV expand: LoRA up-projection added in place, one program per (segment, row tile,
    output column tile).

    Semantics:
        for segment i with slot s = seg_slots[i], for every row r in
        sorted_token_ids[seg_starts[i] : seg_starts[i] + seg_lens[i]]:
            y[r, :] += t[r, :] @ lora_b[s].T
    Shapes: t [T, R], lora_b [num_slots, H_out, R], y [T, H_out]; inner dims stride 1.
        sorted_ids [num_lora_tokens], seg_* [num_segments], all int64.
    Dtypes: t, lora_b, y one of fp32 / fp16 / bf16; the product is accumulated over R in
        BLOCK_K tiles in fp32, added to y in fp32 and stored in y's dtype.
    Grid: (num_segments, cdiv(max_seg_len, BLOCK_M), cdiv(H_out, BLOCK_N)).
    DOT_IN_FP32 upcasts the tiles before tl.dot (set only for bf16 in the interpreter).
    """
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                  # [BM] within segment
    mask_m = offs_m < seg_len
    rows = tl.load(sorted_ids_ptr + seg_start + offs_m, mask=mask_m, other=0)  # [BM] int64
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                  # [BN] output columns
    mask_n = offs_n < H_out
    offs_k = tl.arange(0, BLOCK_K)                                     # [BK] rank

    t_ptrs = t_ptr + rows[:, None] * stride_tm + offs_k[None, :]                  # [BM, BK]
    b_ptrs = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BK, BN]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k in range(0, (R + BLOCK_K - 1) // BLOCK_K):
        k_left = R - k * BLOCK_K
        t_tile = tl.load(t_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b_tile = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if DOT_IN_FP32:
            t_tile = t_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        acc = tl.dot(t_tile, b_tile, acc, input_precision="ieee")
        t_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y_tile = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y_tile.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def kernels_interpreted() -> bool:
    """True when the kernels were decorated under TRITON_INTERPRET=1 (CPU interpreter)."""
    return type(_sgmv_shrink_kernel).__name__ == "InterpretedFunction"


def _tile(n: int, lo: int, hi: int) -> int:
    """Power-of-two tile covering n, clamped to [lo, hi] (tl.dot needs dims >= 16)."""
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _check_launch(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    """Triton-only requirements on top of the shared checks: stride-1 inner dims (other
    strides are passed to the kernels), a device the kernels can run on."""
    for name, tensor in zip(names, tensors, strict=True):
        if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides "
                             f"{tensor.stride()}")
    device = tensors[0].device
    if device.type != "cuda" and not kernels_interpreted():
        raise ValueError(f"Triton LoRA kernels need CUDA tensors, got {device}; on CPU set "
                         "TRITON_INTERPRET=1 before lora.ops.sgmv_triton is imported")


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """Triton's interpreter keeps bf16 as raw uint16 bits and its tl.dot multiplies those
    bits (triton-lang/triton#11584: bf16 is unsupported there), so interpreted bf16 tiles
    are upcast first. Exact: bf16 products are exact in fp32. Native GPU runs keep bf16."""
    return dtype == torch.bfloat16 and kernels_interpreted()


SPLIT_TARGET_PROGRAMS_PER_SM = 2
"""The shrink splits H_in until its grid has about this many programs per SM: a decode step
with few adapters otherwise runs one program per segment, each streaming a whole [R, H_in]
LoRA A through one SM while the rest of the GPU idles (Punica's and vLLM's split-K shrink
answer the same problem)."""


@cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def shrink_splits(programs: int, k_tiles: int, sm_count: int) -> tuple[int, int]:
    """(splits, tiles per split) for a shrink grid of ``programs`` programs before splitting
    and ``k_tiles`` BLOCK_K tiles of H_in on a GPU with ``sm_count`` SMs: as many splits as
    bring the grid near SPLIT_TARGET_PROGRAMS_PER_SM programs per SM, none of them empty
    (splits * tiles_per_split - k_tiles < tiles_per_split)."""
    if programs < 1 or k_tiles < 1 or sm_count < 1:
        raise ValueError(f"programs, k_tiles and sm_count must be positive, got "
                         f"{programs}, {k_tiles}, {sm_count}")
    return _split_plan(k_tiles, (SPLIT_TARGET_PROGRAMS_PER_SM * sm_count) // programs)


def _split_plan(k_tiles: int, wanted: int) -> tuple[int, int]:
    """(splits, tiles per split) closest to ``wanted`` splits of ``k_tiles`` tiles (clamped
    to 1..k_tiles) with no split left empty."""
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(k_tiles, wanted)))
    return triton.cdiv(k_tiles, tiles_per_split), tiles_per_split


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoraBatchMetadata,
                out: torch.Tensor | None = None, *, splits: int | None = None) -> torch.Tensor:
    """Launch the SGMV shrink kernel: out[r] = x[r] @ lora_a[slot(r)].T.

    Shapes: x [T, H_in], lora_a [num_slots, R, H_in] -> out [T, R] (allocated when None);
    rows of tokens without an adapter are zero. Dtypes: fp32 / fp16 / bf16, all the same.
    splits: how many parts H_in is split into (split-K; at most its BLOCK_K tiles), whose
    fp32 partial products are summed into out. None: one on the interpreter, and on a GPU as
    many as fill it (shrink_splits). Raises ValueError on a dtype, device, shape or stride
    mismatch, or splits < 1.
    """
    check_shrink_args(x, lora_a, meta, out)
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be a positive integer, got {splits}")
    rank = lora_a.shape[1]
    if out is None:
        out = x.new_empty(meta.num_tokens, rank)                       # [T, R]
    _check_launch(("x", "lora_a", "out"), (x, lora_a, out))
    if meta.num_lora_tokens < meta.num_tokens:
        out.zero_()
    if meta.num_segments == 0 or rank == 0:
        return out
    # R is tiny, so a program's work is its H_in loop: short row tiles give more programs
    # (a prefill segment still spans many), long K tiles fewer loop trips.
    block_m = _tile(meta.max_seg_len, 16, 32)
    block_n = _tile(rank, 16, 64)
    block_k = _tile(x.shape[1], 16, 128)
    m_tiles, n_tiles = triton.cdiv(meta.max_seg_len, block_m), triton.cdiv(rank, block_n)
    k_tiles = triton.cdiv(x.shape[1], block_k)
    if splits is not None:
        splits, per_split = _split_plan(k_tiles, splits)
    elif x.device.type == "cuda":
        splits, per_split = shrink_splits(meta.num_segments * m_tiles * n_tiles, k_tiles,
                                          _sm_count(x.device.index or 0))
    else:
        splits, per_split = 1, k_tiles
    # With one split the kernel writes out itself; with more, each split writes its own fp32
    # slice (rows without an adapter stay zero) and their sum is the result: no atomics, so
    # the sum's order, and the result, is the same on every run.
    target = out if splits == 1 else (
        x.new_zeros((splits, meta.num_tokens, rank), dtype=torch.float32)
        if meta.num_lora_tokens < meta.num_tokens
        else x.new_empty((splits, meta.num_tokens, rank), dtype=torch.float32))
    _sgmv_shrink_kernel[(meta.num_segments, m_tiles, n_tiles * splits)](
        x, lora_a, target,
        meta.sorted_token_ids, meta.seg_starts, meta.seg_lens, meta.seg_slots,
        x.shape[1], rank, n_tiles, k_tiles, per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1),
        target.stride(0) if splits > 1 else 0, target.stride(-2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_IN_FP32=_dot_in_fp32(x.dtype),
    )
    if splits > 1:
        out.copy_(target.sum(dim=0))
    return out


def sgmv_expand(t: torch.Tensor, lora_b: torch.Tensor, meta: LoraBatchMetadata,
                y: torch.Tensor) -> None:
    """Launch the SGMV expand kernel: y[r] += t[r] @ lora_b[slot(r)].T, in place.

    Shapes: t [T, R], lora_b [num_slots, H_out, R], y [T, H_out] (its rows may be strided,
    e.g. a column slice of a fused projection); rows without an adapter are untouched.
    Dtypes: fp32 / fp16 / bf16, all the same. Raises ValueError on a dtype, device, shape or
    stride mismatch.
    """
    check_expand_args(t, lora_b, meta, y)
    _check_launch(("t", "lora_b", "y"), (t, lora_b, y))
    if meta.num_segments == 0 or y.shape[1] == 0:
        return
    rank, h_out = lora_b.shape[2], lora_b.shape[1]
    block_m = _tile(meta.max_seg_len, 16, 64)
    block_n = _tile(h_out, 16, 64)
    block_k = _tile(rank, 16, 64)
    grid = (meta.num_segments, triton.cdiv(meta.max_seg_len, block_m), triton.cdiv(h_out, block_n))
    _sgmv_expand_kernel[grid](
        t, lora_b, y,
        meta.sorted_token_ids, meta.seg_starts, meta.seg_lens, meta.seg_slots,
        rank, h_out,
        t.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_IN_FP32=_dot_in_fp32(t.dtype),
    )
