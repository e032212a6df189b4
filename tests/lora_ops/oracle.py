"""The fp32 oracle the segmented LoRA ops are checked against, and the batches they run on.

The oracle is a per-token loop written here, independent of both implementations:
    t[r] = x[r] @ A[slot[r]].T,   y[r] += t[r] @ B[slot[r]].T   (tokens with slot -1 skipped)
Batches vary adapter popularity (identical, distinct, uniform, zipf, skewed, some -1 tokens),
token count (1, 3, 7, 133) and request shape (decode: 1 token each; prefill: long requests).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from lora.ops import (
    build_lora_metadata,
)

HAS_CUDA = torch.cuda.is_available()
POPULARITIES = ("identical", "distinct", "uniform", "zipf", "skewed", "with_none")
TOKEN_COUNTS = (1, 3, 7, 133)
LAYOUTS = ("decode", "prefill")
NUM_SLOTS = 6
H_IN, H_OUT, RANK = 72, 40, 8               # not multiples of the kernels' tiles
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

ShrinkFn = Callable[..., torch.Tensor]
ExpandFn = Callable[..., None]
AddFn = Callable[..., None]



def request_lengths(num_tokens: int, layout: str, rng: np.random.Generator) -> list[int]:
    """decode: num_tokens requests of 1 token; prefill: at most 4 long requests."""
    if layout == "decode":
        return [1] * num_tokens
    num_requests = min(4, num_tokens)
    cuts = np.sort(rng.choice(np.arange(1, num_tokens), num_requests - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [num_tokens]])).tolist()


def request_slots(popularity: str, num_requests: int, rng: np.random.Generator) -> list[int]:
    """One slot per request (-1: no adapter), drawn with the given popularity."""
    if popularity == "identical":
        return [3] * num_requests
    if popularity == "distinct":
        perm = rng.permutation(NUM_SLOTS)
        return [int(perm[i % NUM_SLOTS]) for i in range(num_requests)]
    if popularity == "uniform":
        return rng.integers(0, NUM_SLOTS, num_requests).tolist()
    if popularity == "zipf":
        weights = 1.0 / np.arange(1, NUM_SLOTS + 1) ** 1.5
        return rng.choice(NUM_SLOTS, num_requests, p=weights / weights.sum()).tolist()
    if popularity == "skewed":
        hot = rng.random(num_requests) < 0.9
        return np.where(hot, 1, rng.integers(2, NUM_SLOTS, num_requests)).tolist()
    assert popularity == "with_none"
    return rng.integers(-1, NUM_SLOTS, num_requests).tolist()


def make_token_slots(popularity: str, num_tokens: int, layout: str, seed: int = 0) -> list[int]:
    """Flat-batch slot per token: requests contiguous, in no particular slot order."""
    rng = np.random.default_rng(seed)
    lengths = request_lengths(num_tokens, layout, rng)
    slots = request_slots(popularity, len(lengths), rng)
    return [slot for slot, length in zip(slots, lengths, strict=True) for _ in range(length)]


def make_tensors(num_tokens: int, h_in: int, h_out: int, rank: int, dtype: torch.dtype,
                 device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """x, A, B, y0 with O(1) values (A scaled by 1/sqrt(H_in), B by 1/sqrt(R))."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "x": torch.randn(num_tokens, h_in, generator=gen),
        "lora_a": torch.randn(NUM_SLOTS, rank, h_in, generator=gen) / h_in**0.5,
        "lora_b": torch.randn(NUM_SLOTS, h_out, rank, generator=gen) / rank**0.5,
        "y0": torch.randn(num_tokens, h_out, generator=gen),
    }
    return {name: value.to(dtype).to(device) for name, value in tensors.items()}


def oracle(tensors: dict[str, torch.Tensor],
           token_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 per-token loop: (t [T, R], y [T, H_out] = y0 + t @ B.T) on CPU."""
    x, a, b = (tensors[n].float().cpu() for n in ("x", "lora_a", "lora_b"))
    y = tensors["y0"].float().cpu().clone()
    t = torch.zeros(x.shape[0], a.shape[1])
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            t[row] = x[row] @ a[slot].T
            y[row] += t[row] @ b[slot].T
    return t, y


def check_ops(shrink_fn: ShrinkFn, expand_fn: ExpandFn, token_slots: list[int],
              dtype: torch.dtype, device: str, h_in: int = H_IN, h_out: int = H_OUT,
              rank: int = RANK) -> None:
    """shrink, expand (fed the oracle's t) and the chain, each against the oracle."""
    tensors = make_tensors(len(token_slots), h_in, h_out, rank, dtype, device)
    meta = build_lora_metadata(token_slots, device)
    t_ref, y_ref = oracle(tensors, token_slots)
    no_lora = torch.tensor([s < 0 for s in token_slots], dtype=torch.bool)
    tol = TOL[dtype]

    t = shrink_fn(tensors["x"], tensors["lora_a"], meta)
    assert t.dtype == dtype and t.shape == (len(token_slots), rank)
    torch.testing.assert_close(t.float().cpu(), t_ref, rtol=tol, atol=tol)
    assert not t.cpu()[no_lora].any()                   # base-only rows exactly zero

    y = tensors["y0"].clone()
    expand_fn(t_ref.to(dtype).to(device), tensors["lora_b"], meta, y)
    torch.testing.assert_close(y.float().cpu(), y_ref, rtol=tol, atol=tol)
    assert torch.equal(y.cpu()[no_lora], tensors["y0"].cpu()[no_lora])  # untouched

    y = tensors["y0"].clone()
    expand_fn(shrink_fn(tensors["x"], tensors["lora_a"], meta), tensors["lora_b"], meta, y)
    torch.testing.assert_close(y.float().cpu(), y_ref, rtol=2 * tol, atol=2 * tol)


def check_add(add_fn: AddFn, token_slots: list[int], dtype: torch.dtype, device: str) -> None:
    """The fused op (shrink then expand in one call) against the oracle's y."""
    tensors = make_tensors(len(token_slots), H_IN, H_OUT, RANK, dtype, device)
    meta = build_lora_metadata(token_slots, device)
    _, y_ref = oracle(tensors, token_slots)
    no_lora = torch.tensor([s < 0 for s in token_slots], dtype=torch.bool)
    y = tensors["y0"].clone()
    add_fn(tensors["x"], tensors["lora_a"], tensors["lora_b"], meta, y)
    tol = 2 * TOL[dtype]
    torch.testing.assert_close(y.float().cpu(), y_ref, rtol=tol, atol=tol)
    assert torch.equal(y.cpu()[no_lora], tensors["y0"].cpu()[no_lora])  # untouched


SLICES = (40, 24, 24)
"""Output widths of a merged test projection (q/k/v-like: one wide part, two narrow)."""


def check_add_sliced(add_fn: AddFn, token_slots: list[int], dtype: torch.dtype, device: str,
                     slices: tuple[int, ...] = SLICES) -> None:
    """The fused op on a merged projection (add_fn(x, A_stacked, B_stacked, meta, y,
    slices)) against the oracle run per sub-projection, each with its own A and B."""
    parts = [make_tensors(len(token_slots), H_IN, width, RANK, dtype, device, seed=i)
             for i, width in enumerate(slices)]
    x = parts[0]["x"]
    meta = build_lora_metadata(token_slots, device)
    lora_a = torch.cat([p["lora_a"] for p in parts], dim=1)         # [slots, n*R, H_in]
    lora_b = torch.cat([p["lora_b"] for p in parts], dim=1)         # [slots, H_out, R]
    y0 = torch.cat([p["y0"] for p in parts], dim=1)
    y_ref = torch.cat([oracle({**p, "x": x}, token_slots)[1] for p in parts], dim=1)
    y = y0.clone()
    add_fn(x, lora_a, lora_b, meta, y, slices)
    tol = 2 * TOL[dtype]
    torch.testing.assert_close(y.float().cpu(), y_ref, rtol=tol, atol=tol)
    no_lora = torch.tensor([s < 0 for s in token_slots], dtype=torch.bool)
    assert torch.equal(y.cpu()[no_lora], y0.cpu()[no_lora])        # untouched
