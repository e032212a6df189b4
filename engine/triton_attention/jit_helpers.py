"""Triton helpers shared by the paged attention kernels, and the launch-side checks.

The kernels reduce with ``tl.reduce`` over the combine functions below rather than with
``tl.max`` / ``tl.sum``: those are @triton.jit functions of triton itself, decorated when triton
is imported, and a kernel running in Triton's CPU interpreter cannot call a compiled helper.
Helpers decorated here, at this module's import, are interpreted or compiled like the kernels
that call them, so the interpreter works even when triton was imported before
TRITON_INTERPRET was set (the same reason lora/ops/sgmv_triton.py keeps to builtins).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
"""log2(e): the kernels run their softmax in base 2 (exp2 is one instruction on GPUs). A
constexpr: compiled kernels may read no other kind of global."""


@triton.jit
def maximum_combine(a, b):  # type: ignore[no-untyped-def]
    """Combine function of a max reduction."""
    return tl.maximum(a, b)


@triton.jit
def add_combine(a, b):  # type: ignore[no-untyped-def]
    """Combine function of a sum reduction."""
    return a + b


@triton.jit
def soft_cap(scores, cap):  # type: ignore[no-untyped-def]
    """cap * tanh(scores / cap) (Gemma 2's score soft-capping), with tanh written through
    exp since triton.language has no tanh on every version: tanh(x) = 1 - 2 / (exp(2x) + 1),
    which saturates to +-1 without overflow (exp overflowing to inf gives 1 exactly)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))


@triton.jit
def load_kv_tile(  # type: ignore[no-untyped-def]
    k_cache_ptr, v_cache_ptr, table, offs_n, mask_n, offs_d, mask_d, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    PAGE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """K and V of one KV head at positions offs_n, through a block table.

    Position p lives in cache block table[p // PAGE], row p % PAGE. Shapes: offs_n, mask_n
    [BLOCK_N]; offs_d, mask_d [HEAD_DIM_PAD]; returns k, v [BLOCK_N, HEAD_DIM_PAD] in the
    cache dtype (fp32 when DOT_IN_FP32), zero where masked.
    """
    block = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
    row = offs_n % PAGE
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_cache_ptr + block[:, None] * stride_kb + row[:, None] * stride_ks
                + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vb + row[:, None] * stride_vs
                + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def scaled_scores(q, k, scale, softcap, USE_SOFTCAP: tl.constexpr):  # type: ignore[no-untyped-def]
    """q @ k.T times scale, soft-capped when USE_SOFTCAP, in base 2 (times log2 e) for the
    exp2 softmax. q [M, D], k [N, D] -> [M, N] float32 (exact fp32 products for fp32
    inputs: "ieee"; ignored for fp16 / bf16)."""
    scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    return (soft_cap(scores * scale, softcap) * LOG2E if USE_SOFTCAP
            else scores * (scale * LOG2E))


@triton.jit
def online_softmax_step(scores, v, m_i, l_i, acc):  # type: ignore[no-untyped-def]
    """Fold one tile of masked base-2 scores [M, N] (-inf = masked) and its values [N, D]
    into the running max m_i [M], sum l_i [M] and output acc [M, D] (all float32); returns
    the new (m, l, acc). A row with every score so far masked keeps m = -inf; 0 is
    subtracted instead, so no -inf - -inf makes a NaN."""
    m_new = tl.maximum(m_i, tl.reduce(scores, 1, maximum_combine))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(scores - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.reduce(p, 1, add_combine)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


def kernels_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated under TRITON_INTERPRET=1 (Triton's CPU
    interpreter), False when it compiles for the GPU."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """The tensors must be on CUDA, or on the CPU with interpreted kernels."""
    for t in tensors:
        if t.device.type != "cuda" and not kernels_interpreted(kernel):
            raise ValueError(f"Triton attention kernels need CUDA tensors, got {t.device}; on "
                             "CPU set TRITON_INTERPRET=1 before engine.triton_attention's "
                             "kernels are imported")


def dot_in_fp32(kernel: object, dtype: torch.dtype) -> bool:
    """Triton's interpreter keeps bf16 as raw 16-bit patterns and its tl.dot would multiply
    those (triton-lang/triton#11584), so interpreted bf16 tiles are upcast before the dot.
    Exact: bf16 products are exact in fp32. Native GPU runs keep bf16 for the tensor cores."""
    return dtype == torch.bfloat16 and kernels_interpreted(kernel)


def default_block_n(device: torch.device) -> int:
    """Key positions per tile: 64 on a GPU; 16 in the interpreter, whose cost grows with the
    tile and which tests with contexts of a few dozen positions."""
    return 64 if device.type == "cuda" else 16


def pow2_at_least(n: int, floor: int) -> int:
    """The smallest power of two >= max(n, floor); tl.dot needs every dim >= 16."""
    return max(floor, triton.next_power_of_2(max(n, 1)))
