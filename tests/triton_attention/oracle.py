"""A dense float64 oracle for paged attention, written from the definition: every query, one
at a time, against its request's positions gathered through the block table."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Request:
    """One request of a step: its blocks, its first query's position and query count."""

    blocks: list[int]
    start_pos: int
    num_queries: int


def paged_cache(num_blocks: int, page: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, page, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=g).to(device, dtype),
            torch.randn(shape, generator=g).to(device, dtype))


def assign_blocks(lengths: list[int], page: int, num_blocks: int, seed: int) -> list[list[int]]:
    """Distinct, shuffled blocks for each request's positions."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for length in lengths:
        n = -(-length // page)
        tables.append(order[used:used + n])
        used += n
    assert used <= num_blocks, "test cache too small"
    return tables


def oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           requests: list[Request], scale: float, window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """[T, H, D] float64: row r of q is the next query of the requests in order; query i of
    a request sits at position start_pos + i and attends to positions p <= its own (and
    p > own - window)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = k_cache.double().reshape(-1, num_kv_heads, head_dim).cpu()
    values = v_cache.double().reshape(-1, num_kv_heads, head_dim).cpu()
    queries = q.double().cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for req in requests:
        for i in range(req.num_queries):
            pos = req.start_pos + i
            positions = torch.arange(pos + 1)
            slots = torch.tensor(req.blocks)[positions // page] * page + positions % page
            for h in range(num_heads):
                k = keys[slots, h // group]
                scores = (k @ queries[row, h]) * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                if window is not None:
                    scores[positions <= pos - window] = -math.inf
                out[row, h] = torch.softmax(scores, 0) @ values[slots, h // group]
            row += 1
    return out


def tolerance(dtype: torch.dtype) -> float:
    """Max abs error allowed against the oracle for unit-variance inputs: fp32 accumulation
    order only; bf16 / fp16: the output's own rounding (values of a few units) plus the
    probabilities rounded to the input dtype before the PV product on GPUs."""
    return {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
