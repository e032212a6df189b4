"""Segmented (Punica-style) LoRA ops over a flat batch whose tokens use different adapters.

    meta = build_lora_metadata(token_slots, device)   # once per step
    t = shrink(x, lora_a, meta)                        # t[r]  = x[r] @ lora_a[slot(r)].T
    expand(t, lora_b, meta, y)                         # y[r] += t[r] @ lora_b[slot(r)].T
    add_lora(x, lora_a, lora_b, meta, y)               # both (the torch path fuses them)
    add_lora(x, lora_a, lora_b, meta, y, slices=(Oq, Ok, Ov))   # a merged projection

Two backends with the same semantics: "triton" (lora.ops.sgmv_triton, one launch per op)
and "torch" (lora.ops.sgmv_reference, one matmul per distinct slot). With backend="auto",
LORAGATE_LORA_BACKEND (auto | torch | triton) decides when set to torch or triton;
otherwise CUDA tensors use Triton when it is importable and everything else uses torch.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from functools import cache
from typing import Literal, get_args

import torch

from lora.ops.metadata import HostSegment, LoraBatchMetadata, build_lora_metadata
from lora.ops.sgmv_reference import (
    add_lora_reference,
    expand_reference,
    shrink_reference,
    slice_plan,
)

Backend = Literal["auto", "torch", "triton"]
BACKEND_ENV = "LORAGATE_LORA_BACKEND"

__all__ = [
    "BACKEND_ENV",
    "Backend",
    "HostSegment",
    "LoraBatchMetadata",
    "add_lora",
    "add_lora_reference",
    "build_lora_metadata",
    "expand",
    "expand_reference",
    "resolve_backend",
    "shrink",
    "shrink_reference",
    "slice_plan",
    "triton_available",
]


@cache
def triton_available() -> bool:
    """Whether the triton package can be imported (it is optional off CUDA)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: Backend, device: torch.device) -> Literal["torch", "triton"]:
    """The backend an op on `device` uses; raises ValueError for an unknown name."""
    if backend not in get_args(Backend):
        raise ValueError(f"LoRA backend must be one of {get_args(Backend)}, got {backend!r}")
    if backend == "auto":
        env = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
        if env not in get_args(Backend):
            raise ValueError(f"{BACKEND_ENV} must be one of {get_args(Backend)}, got {env!r}")
        if env != "auto":
            backend = env  # type: ignore[assignment]  # checked against Backend just above
        else:
            backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise ValueError("LoRA backend 'triton' requested but triton is not installed")
    return "triton" if backend == "triton" else "torch"


def shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoraBatchMetadata,
           out: torch.Tensor | None = None, *, backend: Backend = "auto") -> torch.Tensor:
    """out[r, :] = x[r, :] @ lora_a[slot(r)].T for every LoRA token r; other rows zero.

    x [T, H_in], lora_a [num_slots, R, H_in] -> out [T, R], all one of fp32 / fp16 / bf16.
    """
    if resolve_backend(backend, x.device) == "triton":
        from lora.ops.sgmv_triton import sgmv_shrink

        return sgmv_shrink(x, lora_a, meta, out)
    return shrink_reference(x, lora_a, meta, out)


def expand(t: torch.Tensor, lora_b: torch.Tensor, meta: LoraBatchMetadata, y: torch.Tensor,
           *, backend: Backend = "auto") -> None:
    """y[r, :] += t[r, :] @ lora_b[slot(r)].T in place for every LoRA token r.

    t [T, R], lora_b [num_slots, H_out, R], y [T, H_out], all one of fp32 / fp16 / bf16;
    the adapter's scaling is pre-folded into lora_b.
    """
    if resolve_backend(backend, t.device) == "triton":
        from lora.ops.sgmv_triton import sgmv_expand

        sgmv_expand(t, lora_b, meta, y)
        return
    expand_reference(t, lora_b, meta, y)


def add_lora(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoraBatchMetadata, y: torch.Tensor, *, slices: Sequence[int] | None = None,
             backend: Backend = "auto") -> None:
    """y[r, :] += (x[r, :] @ lora_a[slot(r)].T) @ lora_b[slot(r)].T in place for every LoRA
    token r: shrink then expand (Triton: the two kernels; torch: one fused pass).

    x [T, H_in], lora_a [num_slots, R, H_in], lora_b [num_slots, H_out, R], y [T, H_out].
    slices: the output widths of a merged projection's sub-projections (q/k/v, gate/up),
    each with its own adapter: lora_a [num_slots, n*R, H_in] stacks their A's, lora_b their
    B's along H_out, and each sub-projection's delta lands in its own columns of y (one
    shrink, one expand per sub-projection; see add_lora_reference).
    """
    if resolve_backend(backend, x.device) == "triton":
        plan = slice_plan(slices, lora_a, lora_b)
        t = shrink(x, lora_a, meta, backend="triton")                      # [T, n*R]
        for ranks, cols in plan:
            expand(t[:, ranks], lora_b[:, cols], meta, y[:, cols], backend="triton")
        return
    add_lora_reference(x, lora_a, lora_b, meta, y, slices)
