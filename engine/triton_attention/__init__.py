"""Paged attention kernels in Triton: the GPU path of engine/attention.py.

    plan = build_triton_plan(decodes, prefills, block_size, window, device, block_m)  # per step
    out = triton_attention(q, k_cache, v_cache, plan, scale)                          # per layer

Decodes run a split-context decode kernel (decode.py), prefill chunks a causal kernel over the
cached prefix and the chunk (prefill.py); both read K/V in place through the block tables, with
grouped-query attention, sliding windows and soft-capping. The torch path of
engine/attention.py is the reference they are tested against. triton is imported only when a
kernel is first called, so this package imports on machines without it.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from typing import Literal, get_args

import torch

from engine.config import AttentionBackend
from engine.triton_attention.plan import (
    TritonAttentionPlan,
    build_triton_plan,
    default_block_m,
    triton_attention,
)

__all__ = [
    "TritonAttentionPlan",
    "build_triton_plan",
    "default_block_m",
    "resolve_attention_backend",
    "triton_attention",
]


@cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_attention_backend(backend: AttentionBackend,
                              device: torch.device) -> Literal["torch", "triton"]:
    """The attention path an engine on ``device`` runs: "auto" takes Triton on CUDA when triton
    is importable and torch elsewhere; "triton" off CUDA needs TRITON_INTERPRET=1 (the CPU
    interpreter: for tests, far too slow to serve)."""
    if backend not in get_args(AttentionBackend):
        raise ValueError(f"attention_backend must be one of {get_args(AttentionBackend)}, "
                         f"got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if not _triton_importable():
        raise ValueError("attention_backend='triton' needs the triton package")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' on a CPU needs TRITON_INTERPRET=1 in the "
                         "environment (Triton's interpreter; for tests only)")
    return "triton"
