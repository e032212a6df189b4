"""Microbenchmark of the segmented LoRA ops on a CUDA GPU: Triton SGMV vs the torch loop.

    python -m benchmarks.lora_kernels [--hidden 4096] [--rank 16] [--dtype bf16] [--iters 200]

For each batch shape it times shrink + expand (one LoRA'd projection, H -> R -> H) with the
Triton kernels and with the torch per-adapter loop (lora.ops.sgmv_reference), checks that
both agree, and prints the base H x H linear beside them for scale. Shapes:

    decode      64 requests x 1 token, 16 distinct adapters (4 requests each, shuffled)
    decode-1    64 requests x 1 token, one adapter for all
    prefill     4 requests x 512 tokens, 4 distinct adapters
    mixed       1 prefill chunk of 256 tokens + 48 decodes, 16 distinct adapters, some base

Needs CUDA and triton; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora.ops import build_lora_metadata, expand_reference, shrink_reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """A batch: per request (num_tokens, slot); slot -1 means no adapter."""

    name: str
    requests: list[tuple[int, int]]

    def token_slots(self) -> list[int]:
        return [slot for length, slot in self.requests for _ in range(length)]


def make_shapes(num_slots: int, seed: int = 0) -> list[Shape]:
    rng = random.Random(seed)
    decode_slots = [i % 16 for i in range(64)]
    rng.shuffle(decode_slots)
    mixed = [(256, 0)] + [(1, rng.choice([-1, *range(16)])) for _ in range(48)]
    shapes = [
        Shape("decode", [(1, s) for s in decode_slots]),
        Shape("decode-1", [(1, 3)] * 64),
        Shape("prefill", [(512, s) for s in (5, 1, 9, 2)]),
        Shape("mixed", mixed),
    ]
    for shape in shapes:
        assert max(slot for _, slot in shape.requests) < num_slots
    return shapes


@dataclass(frozen=True)
class Row:
    """One shape's timings (median µs) and the Triton-vs-torch max abs difference."""

    shape: str
    tokens: int
    segments: int
    triton_us: float
    torch_us: float
    base_us: float
    max_err: float


def time_cuda(fn: Callable[[], object], iters: int, warmup: int = 10) -> float:
    """Median microseconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def bench_shape(shape: Shape, hidden: int, rank: int, num_slots: int, dtype: torch.dtype,
                iters: int) -> Row:
    from lora.ops.sgmv_triton import sgmv_expand, sgmv_shrink

    device = torch.device("cuda")
    token_slots = shape.token_slots()
    num_tokens = len(token_slots)
    meta = build_lora_metadata(token_slots, device)
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)            # [T, H]
    weight = torch.randn(hidden, hidden, device=device, dtype=dtype) / hidden**0.5
    lora_a = torch.randn(num_slots, rank, hidden, device=device, dtype=dtype) / hidden**0.5
    lora_b = torch.randn(num_slots, hidden, rank, device=device, dtype=dtype) / rank**0.5
    y = torch.zeros(num_tokens, hidden, device=device, dtype=dtype)            # [T, H]
    t = torch.empty(num_tokens, rank, device=device, dtype=dtype)             # [T, R]

    def triton_lora() -> None:
        sgmv_expand(sgmv_shrink(x, lora_a, meta, t), lora_b, meta, y)

    def torch_lora() -> None:
        expand_reference(shrink_reference(x, lora_a, meta, t), lora_b, meta, y)

    y_triton, y_torch = torch.zeros_like(y), torch.zeros_like(y)
    sgmv_expand(sgmv_shrink(x, lora_a, meta), lora_b, meta, y_triton)
    expand_reference(shrink_reference(x, lora_a, meta), lora_b, meta, y_torch)
    max_err = (y_triton.float() - y_torch.float()).abs().max().item()

    triton_us = time_cuda(triton_lora, iters)
    torch_us = time_cuda(torch_lora, iters)
    base_us = time_cuda(lambda: x @ weight.T, iters)
    return Row(shape.name, num_tokens, meta.num_segments, triton_us, torch_us, base_us, max_err)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Triton SGMV vs torch LoRA loop on CUDA")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-slots", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.lora_kernels needs a CUDA GPU (torch.cuda.is_available() "
                         "is False); the CPU path is covered by tests/test_lora_ops.py")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks.lora_kernels needs triton (pip install triton)") from None

    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}  hidden={args.hidden} rank={args.rank} "
          f"dtype={args.dtype} slots={args.num_slots}  (median of {args.iters}, µs)")
    header = (f"{'shape':<10}{'tokens':>8}{'segs':>6}{'triton':>10}{'torch':>10}"
              f"{'speedup':>9}{'base HxH':>10}{'max|err|':>10}")
    print(header)
    print("-" * len(header))
    for shape in make_shapes(args.num_slots):
        row = bench_shape(shape, args.hidden, args.rank, args.num_slots, dtype, args.iters)
        print(f"{row.shape:<10}{row.tokens:>8}{row.segments:>6}{row.triton_us:>10.1f}"
              f"{row.torch_us:>10.1f}{row.torch_us / row.triton_us:>8.2f}x{row.base_us:>10.1f}"
              f"{row.max_err:>10.2e}")


if __name__ == "__main__":
    main()
