"""The engine's model forward on a real checkpoint, timed and broken down by op kind.

    python -m benchmarks.forward_profile [--model DIR] [--threads 2] [--repeats 20]
                                         [--adapters 0] [--only decode,prefill]
                                         [--no-prepack] [--no-cascade] [--no-native]
                                         [--dtype float32|bfloat16]
                                         [--no-profile]
                                         [--json PATH]

Times LlamaForFlatBatch.forward + compute_logits of the sampled rows (what the runner's
forward_seconds covers) on fixed batches, each over its own paged KV (block 32; fp32, or
bf16 with --dtype bfloat16; attention on the engine's paths: the compiled decode kernel,
and in fp32 the compiled span kernel for cascade attention):

    decode       32 sequences x 1 token, contexts 284..315 (about 300), no shared blocks
    rag-decode   32 sequences x 1 token over 8 shared 992-token documents (groups of 11..1)
                 plus private tails of 40-70 tokens
    prefill      one 512-token prefill chunk of a new prompt (no cached context)
    prefill-ctx  a 512-token chunk after 512 cached tokens (the second chunk of a long prompt)

With --adapters N, every sequence uses one of N random rank-8 adapters on q/k/v/o
(round-robin over the decode batch; the prefill chunks use slot 0).

Then one torch.profiler pass per batch attributes the forward's wall time to op kinds by
wrapping the model's named pieces in record_function scopes (time inside a nested scope
counts for the inner one only): gemm (the base projections), lora (the adapter deltas),
attention (KV write + paged attention), norm, rope, act, lm_head, and other (embedding,
residual adds, views, Python between ops). Profiling adds overhead per op, so the table's
shares matter more than its absolute numbers; the timings above it run unprofiled.

Each batch prints the median wall time and the median process CPU time per forward. On a
shared host run with --threads 1 and compare CPU times (A B A B): they do not count the time
the process waits for a core. --no-prepack, --no-cascade and --no-native switch to the
reference GEMM and attention paths (EngineConfig.prepack_weights / cascade_attention /
native_kernels off).

Defaults to the default model (SmolLM2-135M-Instruct under ~/.cache/loragate/models).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import engine.models.llama as llama_mod
import lora.layers as layers_mod
from engine.attention import build_step_metadata
from engine.cascade_spans import span_kernel_fits
from engine.cpu_kernels import (
    FusedOps,
    PagedDecodeOp,
    SpanAttentionOp,
    load_fused_ops,
    load_paged_decode,
    load_span_attention,
)
from engine.default_model import default_model_dir
from engine.models.gemma import GemmaRMSNorm
from engine.models.llama import LlamaForFlatBatch, RMSNorm
from engine.models.loader import load_hf_config, load_model
from engine.paged_decode import CopyBuffers
from lora.adapter import LoraAdapter
from lora.layers import LoraSlots
from lora.ops import LoraBatchMetadata, build_lora_metadata

BLOCK_SIZE = 32
SCOPE = "fp::"


@dataclass
class Batch:
    """One forward's inputs."""

    name: str
    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: dict[int | None, Any]
    sample_rows: torch.Tensor
    lora: LoraBatchMetadata | None
    num_tokens: int


@dataclass
class Result:
    """Timings of one batch (ms, unprofiled) and the profiled breakdown (ms per forward)."""

    name: str
    num_tokens: int
    median_ms: float
    min_ms: float
    cpu_median_ms: float
    tokens_per_s: float
    breakdown_ms: dict[str, float] = field(default_factory=dict)


def make_batches(model: LlamaForFlatBatch, adapters: int,
                 cascade: bool = True, kernel: PagedDecodeOp | None = None,
                 span_kernel: SpanAttentionOp | None = None) -> tuple[list[Batch], int]:
    """The three batches, each on its own blocks; returns them and the blocks they need."""
    windows = tuple(dict.fromkeys(model.shape.layer_windows))
    gen = torch.Generator().manual_seed(0)
    vocab = model.shape.vocab_size
    next_block = 0

    def blocks(n_tokens: int) -> list[int]:
        nonlocal next_block
        n = -(-n_tokens // BLOCK_SIZE)
        next_block += n
        return list(range(next_block - n, next_block))

    batches = []
    buffers = CopyBuffers()  # as the engine's runner keeps them
    ctxs = [284 + i for i in range(32)]
    decodes = [(blocks(c), c) for c in ctxs]
    slots = [i % adapters for i in range(32)] if adapters else []
    batches.append(Batch(
        "decode", torch.randint(vocab, (32,), generator=gen),
        torch.tensor([c - 1 for c in ctxs]),
        build_step_metadata(decodes, [], BLOCK_SIZE, windows, torch.device("cpu"), cascade=cascade,
                            buffers=buffers, kernel=kernel, span_kernel=span_kernel),
        torch.arange(32), build_lora_metadata(slots, "cpu") if adapters else None, 32))
    # RAG decodes: 32 sequences over 8 shared 992-token documents (Zipf-like group sizes),
    # each with a private tail of 40-70 tokens (question + answer so far).
    docs = [blocks(992) for _ in range(8)]
    rag = []
    for doc, group in enumerate((11, 6, 4, 3, 3, 2, 2, 1)):
        for j in range(group):
            tail = 40 + (7 * j + 3 * doc) % 31
            rag.append((docs[doc] + blocks(tail), 992 + tail))
    batches.append(Batch(
        "rag-decode", torch.randint(vocab, (32,), generator=gen),
        torch.tensor([c - 1 for _, c in rag]),
        build_step_metadata(rag, [], BLOCK_SIZE, windows, torch.device("cpu"), cascade=cascade,
                            buffers=buffers, kernel=kernel, span_kernel=span_kernel),
        torch.arange(32), build_lora_metadata(slots, "cpu") if adapters else None, 32))
    for name, start in (("prefill", 0), ("prefill-ctx", 512)):
        bt = blocks(start + 512)
        batches.append(Batch(
            name, torch.randint(vocab, (512,), generator=gen),
            torch.arange(start, start + 512),
            build_step_metadata([], [(bt, start, 512)], BLOCK_SIZE, windows,
                                torch.device("cpu"), cascade=cascade, buffers=buffers,
                                kernel=kernel, span_kernel=span_kernel),
            torch.tensor([511]), build_lora_metadata([0] * 512, "cpu") if adapters else None,
            512))
    return batches, next_block


def random_adapter(model: LlamaForFlatBatch, index: int, rank: int = 8) -> LoraAdapter:
    """A rank-`rank` adapter on q/k/v/o of every layer, scaled like a trained one."""
    gen = torch.Generator().manual_seed(1000 + index)
    dims = model.shape.lora_targets()
    weights = {}
    for layer in range(model.shape.num_layers):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            fan_in, fan_out = dims.module_dims(module)
            a = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            b = torch.randn(fan_out, rank, generator=gen) * 0.01
            weights[(layer, module)] = (a, b)
    return LoraAdapter(f"rand{index}", "", f"d{index}", rank, 16.0, False, weights)


def run_forward(model: LlamaForFlatBatch, kv: list[tuple[torch.Tensor, torch.Tensor]],
                batch: Batch) -> torch.Tensor:
    hidden = model(batch.input_ids, batch.positions, kv, batch.metas, batch.lora)
    return model.compute_logits(hidden[batch.sample_rows])


def time_batch(model: LlamaForFlatBatch, kv: list[tuple[torch.Tensor, torch.Tensor]],
               batch: Batch, repeats: int, warmup: int = 2) -> tuple[list[float], list[float]]:
    """(wall ms, process CPU ms) per forward. On a shared host the CPU time of a
    one-thread run is the steadier figure: it does not count time spent descheduled."""
    for _ in range(warmup):
        run_forward(model, kv, batch)
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        run_forward(model, kv, batch)
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return wall, cpu


@contextlib.contextmanager
def scoped(model: LlamaForFlatBatch) -> Iterator[None]:
    """Wrap the model's named pieces in record_function scopes while profiling."""
    undo: list[Callable[[], None]] = []

    def wrap(owner: Any, attr: str, kind: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with record_function(SCOPE + kind):
                return original(*args, **kwargs)

        setattr(owner, attr, wrapped)
        undo.append(lambda: setattr(owner, attr, original))

    wrap(llama_mod, "paged_attention", "attention")
    wrap(llama_mod, "apply_rope", "rope")
    wrap(layers_mod.LoraLinear, "forward", "gemm")
    for name in ("add_lora", "add_lora_sliced"):
        wrap(layers_mod, name, "lora")
    for norm_class in (RMSNorm, GemmaRMSNorm):
        wrap(norm_class, "forward", "norm")
    wrap(type(model), "compute_logits", "lm_head")
    fused = model.fused_ops
    if fused is not None:  # the compiled ops (a residual add fused into a norm counts as norm)
        def timed(kind: str, op: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any) -> Any:
                with record_function(SCOPE + kind):
                    return op(*args)
            return run

        model.use_fused_ops(FusedOps(
            rms_norm=timed("norm", fused.rms_norm),
            add_rms_norm=timed("norm", fused.add_rms_norm),
            rotary_=timed("rope", fused.rotary_), silu_and_mul=timed("act", fused.silu_and_mul)))
        undo.append(lambda: model.use_fused_ops(fused))
    for module in model.modules():
        if hasattr(module, "act") and callable(module.act):
            wrap(module, "act", "act")
    try:
        yield
    finally:
        for restore in reversed(undo):
            restore()


def breakdown(model: LlamaForFlatBatch, kv: list[tuple[torch.Tensor, torch.Tensor]],
              batch: Batch, passes: int = 3) -> dict[str, float]:
    """ms per forward by op kind (exclusive of nested scopes), from a profiled run."""
    with scoped(model):
        run_forward(model, kv, batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(passes):
                with record_function(SCOPE + "other"):
                    run_forward(model, kv, batch)
    totals: dict[str, float] = {}
    for event in prof.events():
        if not event.name.startswith(SCOPE):
            continue
        duration = event.time_range.elapsed_us()
        kind = event.name[len(SCOPE):]
        totals[kind] = totals.get(kind, 0.0) + duration
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(SCOPE):
            parent = parent.cpu_parent
        if parent is not None:
            outer = parent.name[len(SCOPE):]
            totals[outer] = totals.get(outer, 0.0) - duration
    return {k: v / passes / 1e3 for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--adapters", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated batch names")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-cascade", action="store_true",
                        help="reference paged attention (EngineConfig.cascade_attention=False)")
    parser.add_argument("--no-native", action="store_true",
                        help="torch decode attention and eager element-wise ops "
                             "(EngineConfig.native_kernels=False)")
    parser.add_argument("--no-prepack", action="store_true",
                        help="plain F.linear GEMMs (EngineConfig.prepack_weights=False)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights, activations and KV cache (bfloat16: the fast dtype on "
                             "CPUs with AMX)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)

    config = load_hf_config(args.model)
    extra = ({"prepack_weights": not args.no_prepack}
             if "prepack_weights" in inspect.signature(load_model).parameters else {})
    model = load_model(args.model, config, dtype, torch.device("cpu"), 4096, **extra)
    model.use_fused_ops(None if args.no_native else load_fused_ops())
    native = not args.no_native
    span = (load_span_attention() if native and not args.no_cascade
            and span_kernel_fits(dtype, model.shape.head_dim) else None)
    batches, num_blocks = make_batches(model, args.adapters, cascade=not args.no_cascade,
                                      kernel=load_paged_decode() if native else None,
                                      span_kernel=span)
    if args.only:
        batches = [b for b in batches if b.name in args.only.split(",")]
    s = model.shape
    gen = torch.Generator().manual_seed(1)
    kv = [(torch.randn(num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim, generator=gen,
                       dtype=dtype),
           torch.randn(num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim, generator=gen,
                       dtype=dtype))
          for _ in range(s.num_layers)]
    if args.adapters:
        slots = LoraSlots(model.model.layers, s.lora_targets(), args.adapters, 8,
                          dtype, torch.device("cpu"))
        for i in range(args.adapters):
            slots.load(i, random_adapter(model, i))

    results = []
    with torch.inference_mode():
        for batch in batches:
            times, cpu = time_batch(model, kv, batch, args.repeats)
            med = statistics.median(times)
            result = Result(batch.name, batch.num_tokens, med, min(times),
                            statistics.median(cpu), batch.num_tokens / med * 1e3)
            if not args.no_profile:
                result.breakdown_ms = breakdown(model, kv, batch)
            results.append(result)
            print(f"{batch.name:12s} {batch.num_tokens:4d} tokens  median {med:8.2f} ms  "
                  f"min {min(times):8.2f} ms  cpu {result.cpu_median_ms:8.2f} ms  "
                  f"{result.tokens_per_s:8.1f} tok/s", flush=True)
    for result in results:
        if not result.breakdown_ms:
            continue
        total = sum(result.breakdown_ms.values())
        print(f"\n{result.name} (profiled {total:.2f} ms per forward)")
        for kind, ms in result.breakdown_ms.items():
            print(f"  {kind:10s} {ms:8.2f} ms  {100 * ms / total:5.1f} %")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
