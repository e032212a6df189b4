"""The Triton paged attention kernels against the float64 oracle (oracle.py).

Without CUDA the kernels run in Triton's interpreter (conftest.py) over small shapes; with
CUDA the same checks run natively, and the gpu-marked tests add long contexts and real sizes.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from engine.triton_attention import build_triton_plan, triton_attention
from tests.triton_attention.oracle import (
    Request,
    assign_blocks,
    oracle,
    paged_cache,
    tolerance,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _decode(kernels: dict[str, ModuleType], device: torch.device, page: int, head_dim: int,
            heads: int, kv_heads: int, lengths: list[int], dtype: torch.dtype,
            window: int | None = None, softcap: float | None = None,
            partition: int | None = None, seed: int = 0) -> None:
    num_blocks = sum(-(-n // page) for n in lengths) + 3
    k_cache, v_cache = paged_cache(num_blocks, page, kv_heads, head_dim, dtype, device, seed)
    tables = assign_blocks(lengths, page, num_blocks, seed)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                device=device)
    q = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(seed)
                    ).to(device, dtype)
    scale = 1 / math.sqrt(head_dim)
    out, lse = kernels["decode"].paged_decode_attention(
        q, k_cache, v_cache, block_tables,
        torch.tensor(lengths, dtype=torch.int32, device=device), max(lengths), scale,
        sliding_window=window, softcap=softcap, partition_size=partition)
    requests = [Request(t, n - 1, 1) for t, n in zip(tables, lengths, strict=True)]
    expected = oracle(q, k_cache, v_cache, requests, scale, window, softcap)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.double().cpu() - expected).abs().max().item()
    assert err <= tolerance(dtype), f"max error {err}"
    assert lse.shape == (len(lengths), heads) and torch.isfinite(lse).all()


@pytest.mark.parametrize(
    ("page", "head_dim", "heads", "kv_heads"),
    [(8, 64, 4, 4), (16, 128, 8, 2), (16, 64, 6, 2)],
    ids=["mha-d64", "gqa4-d128", "gqa3-d64"])
@pytest.mark.parametrize("partition", [None, 32], ids=["one-split", "split32"])
def test_decode_lengths_across_blocks_and_splits(kernels: dict[str, ModuleType],
                                                 device: torch.device, page: int, head_dim: int,
                                                 heads: int, kv_heads: int,
                                                 partition: int | None) -> None:
    # 1 position; just under, at and over a block; several blocks; over two split boundaries.
    lengths = [1, page - 1, page, page + 1, 3 * page + 5, 70]
    _decode(kernels, device, page, head_dim, heads, kv_heads, lengths, torch.float32,
            partition=partition)


@pytest.mark.parametrize(("window", "softcap"), [(10, None), (None, 5.0), (40, 3.0)],
                         ids=["window", "softcap", "both"])
def test_decode_window_and_softcap(kernels: dict[str, ModuleType], device: torch.device,
                                   window: int | None, softcap: float | None) -> None:
    # Windows shorter than a split leave whole splits empty: their -inf lse must drop out.
    _decode(kernels, device, 8, 64, 4, 2, [3, 9, 33, 70], torch.float32, window, softcap,
            partition=16)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_decode_half_precision(kernels: dict[str, ModuleType], device: torch.device,
                               dtype: str) -> None:
    _decode(kernels, device, 16, 64, 8, 2, [5, 40, 66], DTYPES[dtype], partition=32)


def _step(kernels: dict[str, ModuleType], device: torch.device, page: int, head_dim: int,
          heads: int, kv_heads: int, decode_lengths: list[int],
          chunks: list[tuple[int, int]], dtype: torch.dtype, window: int | None = None,
          softcap: float | None = None, seed: int = 0) -> None:
    """One flat step through the plan: decodes (context lengths), then chunks (start_pos,
    num_queries) whose prefix is already cached."""
    lengths = decode_lengths + [start + n for start, n in chunks]
    num_blocks = sum(-(-n // page) for n in lengths) + 3
    k_cache, v_cache = paged_cache(num_blocks, page, kv_heads, head_dim, dtype, device, seed)
    tables = assign_blocks(lengths, page, num_blocks, seed)
    nd = len(decode_lengths)
    requests = ([Request(t, n - 1, 1) for t, n in zip(tables[:nd], decode_lengths, strict=True)]
                + [Request(t, s, n) for t, (s, n) in zip(tables[nd:], chunks, strict=True)])
    total = sum(r.num_queries for r in requests)
    q = torch.randn(total, heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)
                    ).to(device, dtype)
    plan = build_triton_plan(
        [(t, n) for t, n in zip(tables[:nd], decode_lengths, strict=True)],
        [(t, s, n) for t, (s, n) in zip(tables[nd:], chunks, strict=True)],
        page, window, device, 64 if device.type == "cuda" else 16)
    scale = 1 / math.sqrt(head_dim)
    out = triton_attention(q, k_cache, v_cache, plan, scale, softcap)
    expected = oracle(q, k_cache, v_cache, requests, scale, window, softcap)
    err = (out.double().cpu() - expected).abs().max().item()
    assert err <= tolerance(dtype), f"max error {err}"


@pytest.mark.parametrize(
    ("page", "head_dim", "heads", "kv_heads"),
    [(8, 64, 4, 4), (16, 128, 8, 2)], ids=["mha-d64", "gqa4-d128"])
def test_prefill_chunks_over_cached_prefixes(kernels: dict[str, ModuleType],
                                             device: torch.device, page: int, head_dim: int,
                                             heads: int, kv_heads: int) -> None:
    # A fresh prompt over two query tiles; a chunk after a block-aligned prefix hit; one
    # after an unaligned prefix; a one-token chunk (a prefill's last token).
    chunks = [(0, 37), (2 * page, 20), (5, 9), (30, 1)]
    _step(kernels, device, page, head_dim, heads, kv_heads, [], chunks, torch.float32)


@pytest.mark.parametrize(("window", "softcap"), [(9, None), (None, 4.0), (20, 2.0)],
                         ids=["window", "softcap", "both"])
def test_mixed_step_window_and_softcap(kernels: dict[str, ModuleType], device: torch.device,
                                       window: int | None, softcap: float | None) -> None:
    # Windowed rows late in a tile see no key in the tile's first key block: the -inf rows
    # must not poison the running max.
    _step(kernels, device, 8, 32, 4, 2, [1, 26], [(0, 40), (17, 12)], torch.float32, window,
          softcap)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_step_half_precision(kernels: dict[str, ModuleType], device: torch.device,
                                   dtype: str) -> None:
    _step(kernels, device, 16, 64, 8, 2, [19, 50], [(0, 33), (32, 17)], DTYPES[dtype])


# --------------------------------------------------------------------- native, on a GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_gpu_decode_long_contexts(kernels: dict[str, ModuleType], device: torch.device,
                                  dtype: str) -> None:
    # Llama-3-8B's attention shape; contexts across the default split policy's boundaries.
    _decode(kernels, device, 16, 128, 32, 8, [1, 17, 1000, 4099, 8192, 300], DTYPES[dtype],
            window=None)
    _decode(kernels, device, 16, 128, 32, 8, [4099, 8192], DTYPES[dtype], window=1000)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_mixed_step_real_sizes(kernels: dict[str, ModuleType], device: torch.device,
                                   dtype: str) -> None:
    _step(kernels, device, 16, 128, 32, 8, [7, 2000, 513],
          [(0, 300), (1024, 512), (100, 1)], DTYPES[dtype])
    _step(kernels, device, 16, 128, 32, 8, [3000], [(2048, 256)], DTYPES[dtype], window=700,
          softcap=30.0)
