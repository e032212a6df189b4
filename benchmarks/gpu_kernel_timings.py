"""Kernel timings against the memory roofline, for benchmarks/gpu_check.py.

Decode attention and SGMV at decode sizes are memory-bound: their floor is the bytes they
must move divided by the device's bandwidth, which is measured here too (a device-to-device
copy, bytes read plus written) rather than taken from a datasheet.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch


def time_call(fn: Callable[[], object], device: torch.device, iters: int,
              warmup: int = 3) -> float:
    """Mean seconds per call: CUDA events on a GPU, wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1000 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def device_time(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean seconds per call of the device work alone: on a GPU ``iters`` calls captured in
    one CUDA graph and replayed (no host launch cost between kernels); elsewhere time_call."""
    if device.type != "cuda":
        return time_call(fn, device, iters)
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return time_call(graph.replay, device, 3, warmup=1) / iters


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, iters)
    return 2 * src.numel() * src.element_size() / seconds


def decode_attention_timings(device: torch.device, bandwidth: float, seq_counts: list[int],
                             contexts: list[int], heads: int, kv_heads: int, head_dim: int,
                             page: int, dtype: torch.dtype, iters: int) -> list[dict[str, Any]]:
    """engine.triton_attention's decode kernel over shuffled blocks, each sequence count x
    context length: device time (graph replay) and time per call with its host launch, bytes
    of K/V read, achieved bandwidth and its share of the copy bandwidth."""
    from engine.triton_attention.decode import paged_decode_attention

    rows = []
    for context in contexts:
        for seqs in seq_counts:
            blocks_per_seq = -(-context // page)
            num_blocks = seqs * blocks_per_seq
            k_cache = torch.randn(num_blocks, page, kv_heads, head_dim, device=device,
                                  dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            tables = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(
                torch.int32).view(seqs, blocks_per_seq)
            lens = torch.full((seqs,), context, dtype=torch.int32, device=device)
            q = torch.randn(seqs, heads, head_dim, device=device, dtype=dtype)
            out = torch.empty_like(q)

            run = partial(paged_decode_attention, q, k_cache, v_cache, tables, lens, context,
                          1 / math.sqrt(head_dim), out=out)
            seconds = device_time(run, device, iters)
            launched = time_call(run, device, iters)
            nbytes = 2 * seqs * context * kv_heads * head_dim * k_cache.element_size()
            rows.append({"seqs": seqs, "context": context, "us": seconds * 1e6,
                         "us_with_launch": launched * 1e6,
                         "kv_bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9,
                         "roofline_fraction": nbytes / seconds / bandwidth})
            del k_cache, v_cache
    return rows


def sgmv_timings(device: torch.device, bandwidth: float, adapter_counts: list[int], hidden: int,
                 rank: int, tokens: int, dtype: torch.dtype, iters: int) -> list[dict[str, Any]]:
    """lora.ops' Triton shrink and expand for a decode batch of ``tokens`` rows spread
    round-robin over each number of adapters: device time (graph replay) and share of the
    memory roofline (the adapters' weights plus the activations read and written); the
    shrink also without its split over H_in, to show what the split buys."""
    from lora.ops import build_lora_metadata
    from lora.ops.sgmv_triton import sgmv_expand, sgmv_shrink

    rows = []
    for count in adapter_counts:
        lora_a = torch.randn(count, rank, hidden, device=device, dtype=dtype) * 0.02
        lora_b = torch.randn(count, hidden, rank, device=device, dtype=dtype) * 0.02
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        y = torch.zeros(tokens, hidden, device=device, dtype=dtype)
        meta = build_lora_metadata([i % count for i in range(tokens)], device)
        t = sgmv_shrink(x, lora_a, meta)
        used = min(count, tokens)
        elem = x.element_size()
        shrink_bytes = (used * rank * hidden + tokens * hidden + tokens * rank) * elem
        expand_bytes = (used * hidden * rank + tokens * rank + 2 * tokens * hidden) * elem
        shrink_s = device_time(partial(sgmv_shrink, x, lora_a, meta, t), device, iters)
        unsplit_s = device_time(partial(sgmv_shrink, x, lora_a, meta, t, splits=1), device,
                                iters)
        expand_s = device_time(partial(sgmv_expand, t, lora_b, meta, y), device, iters)
        rows.append({"adapters": count, "tokens": tokens, "hidden": hidden, "rank": rank,
                     "shrink_us": shrink_s * 1e6, "shrink_unsplit_us": unsplit_s * 1e6,
                     "expand_us": expand_s * 1e6,
                     "shrink_roofline_fraction": shrink_bytes / shrink_s / bandwidth,
                     "expand_roofline_fraction": expand_bytes / expand_s / bandwidth})
    return rows
