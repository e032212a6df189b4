"""Multi-LoRA throughput: the engine with 0 / 1 / 4 / 16 / 64 adapters vs PEFT per-adapter
batching.

    python -m benchmarks.lora_throughput --model DIR [--num-requests 128] [--repeats 1]
        [--threads N] [--adapter-counts 1,4,16,64] [--distributions uniform,zipf] [--quick]

One seeded mixed workload (prompts 32-256, outputs 32-128 tokens, greedy, ignore_eos, every
request added at once) is served several times in one run:

1. the engine without LoRA (max_loras=0, every request on the base model): the reference;
2. the engine (max_loras=16, max_cpu_loras=64, max_lora_rank=16, max_num_seqs=64) with 1, 4,
   16 and 64 distinct adapters (``--adapter-counts``; 16 is always run), requests spread
   over them uniformly or by a zipf(s=1.1) popularity (``--distributions``; uniform is
   always run); each is reported as a ratio to (1);
3. the PEFT-style baseline for the 16-adapter uniform assignment: one transformers
   ``PeftModel`` holding all 16 adapters, requests grouped by adapter, ``set_adapter`` and a
   static left-padded ``generate`` per batch of at most 64 same-adapter requests, each batch
   generating its longest member's output length.

Each configuration gets a fresh engine (construction, adapter registration and a one-request
warm-up are untimed); the timer covers adding and serving the whole workload. Only the
tokens each request asked for are counted. The adapters (seeded PEFT directories, ranks
alternating 8 and 16, all seven projections, b_scale=0.2, made by PEFT for the model's own
shapes) are written once under DIR/bench-adapters and reused. With --repeats N every
configuration (and the baseline) is served N times round-robin and the fastest run is
reported. --quick is a smoke test of the whole matrix (16 requests, outputs of 16-32
tokens); its numbers are not the benchmark.

Results are printed and written as JSON (default benchmarks/results/lora_throughput.json).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from transformers import AutoConfig
from transformers.utils import logging as hf_logging

from benchmarks.bench_adapters import (
    ADAPTER_B_SCALE,
    ADAPTER_SEED,
    adapter_name,
    bench_adapters_dir,
    ensure_adapters,
)
from benchmarks.lora_engine_run import (
    MAX_CPU_LORAS,
    MAX_LORA_RANK,
    MAX_LORAS,
    MAX_NUM_SEQS,
    EngineRun,
    run_engine,
)
from benchmarks.peft_baseline import run_peft_baseline
from benchmarks.throughput import RunResult, machine_info, write_json
from benchmarks.workloads import (
    BenchRequest,
    LengthRange,
    WorkloadSpec,
    generate,
    total_output_tokens,
)
from lora.adapter import SUPPORTED_MODULES

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "lora_throughput.json"
PROMPT_LEN = LengthRange(32, 256)
OUTPUT_LEN = LengthRange(32, 128)
QUICK_OUTPUT_LEN = LengthRange(16, 32)
"""--quick is a smoke test of the whole matrix: fewer requests and shorter outputs."""
ADAPTER_COUNTS = (1, 4, 16, 64)
DISTRIBUTIONS = ("uniform", "zipf")
ZIPF_S = 1.1
BASELINE_ADAPTERS = 16
BASELINE_DISTRIBUTION = "uniform"
BASELINE_TARGET = 4.0
"""Engine (16 adapters, uniform) over the PEFT per-adapter baseline."""
BASE_RATIO_TARGET = 0.7
"""Engine (16 adapters, uniform) over the engine without adapters."""


# ------------------------------------------------------------------------ workload
def popularity(num_adapters: int, distribution: str) -> list[float]:
    """Unnormalised probability of each adapter: equal, or zipf 1 / (k + 1)^s by index."""
    if distribution == "uniform":
        return [1.0] * num_adapters
    if distribution == "zipf":
        return [1.0 / (k + 1) ** ZIPF_S for k in range(num_adapters)]
    raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")


def assign_adapters(num_requests: int, num_adapters: int, distribution: str,
                    seed: int) -> list[str]:
    """The adapter of each request, drawn independently from the popularity; seeded per
    (seed, distribution, count) so every configuration is reproducible on its own."""
    rng = random.Random(f"{seed}-{distribution}-{num_adapters}")
    indices = rng.choices(range(num_adapters), weights=popularity(num_adapters, distribution),
                          k=num_requests)
    return [adapter_name(i) for i in indices]


# --------------------------------------------------------------------------- report
def print_table(runs: list[EngineRun], baseline: RunResult) -> None:
    reference = runs[0].result
    header = (f"{'configuration':<26}{'used':>5}{'tok/s':>9}{'vs base':>9}{'by cpu':>8}"
              f"{'seconds':>9}{'steps':>7}{'batch':>7}{'loads':>7}{'load1':>7}")
    print("\n" + header)
    for run in runs:
        r = run.result
        print(f"{run.label:<26}{run.distinct_adapters_used:>5}{r.output_tokens_per_s:>9.2f}"
              f"{r.output_tokens_per_s / reference.output_tokens_per_s:>9.2f}"
              f"{reference.cpu_seconds / r.cpu_seconds:>8.2f}{r.seconds:>9.1f}"
              f"{run.num_steps:>7}{run.mean_requests_per_step:>7.1f}{run.slot_loads:>7}"
              f"{run.load_average[0]:>7.1f}")
    print(f"{baseline.name:<26}{BASELINE_ADAPTERS:>5}{baseline.output_tokens_per_s:>9.2f}"
          f"{baseline.output_tokens_per_s / reference.output_tokens_per_s:>9.2f}"
          f"{reference.cpu_seconds / baseline.cpu_seconds:>8.2f}{baseline.seconds:>9.1f}")
    print("used = distinct adapters in the workload; vs base = tok/s ratio to the no-adapter "
          "engine; by cpu = the same ratio by process CPU time; batch = requests given a "
          "token per step; loads = adapter copies into device slots; load1 = 1-min load "
          "average at the start")


def target_ratios(runs: list[EngineRun], baseline: RunResult) -> dict[str, float]:
    reference = runs[0].result
    lora = next(r.result for r in runs if r.num_adapters == BASELINE_ADAPTERS
                and r.distribution == BASELINE_DISTRIBUTION)
    return {
        "lora16_over_peft": lora.output_tokens_per_s / baseline.output_tokens_per_s,
        "lora16_over_peft_by_cpu": baseline.cpu_seconds / lora.cpu_seconds,
        "lora16_over_base": lora.output_tokens_per_s / reference.output_tokens_per_s,
        "lora16_over_base_by_cpu": reference.cpu_seconds / lora.cpu_seconds,
    }


def print_targets(ratios: dict[str, float]) -> None:
    for key, target, text in (("lora16_over_peft", BASELINE_TARGET, "PEFT per-adapter"),
                              ("lora16_over_base", BASE_RATIO_TARGET, "no-adapter engine")):
        verdict = "PASS" if ratios[key] >= target else "FAIL"
        print(f"16 adapters (uniform) / {text}: {ratios[key]:.2f} "
              f"(target >= {target}) {verdict}; by process CPU time "
              f"{ratios[key + '_by_cpu']:.2f}")


# ----------------------------------------------------------------------------- main
@dataclass(frozen=True)
class Configuration:
    """One engine configuration: how many adapters and how requests pick among them."""

    num_adapters: int
    distribution: str | None

    @property
    def label(self) -> str:
        if not self.num_adapters:
            return "no adapters"
        return f"{self.num_adapters} adapters, {self.distribution}"


def configurations(counts: Sequence[int] = ADAPTER_COUNTS,
                   distributions: Sequence[str] = DISTRIBUTIONS) -> list[Configuration]:
    """The reference first, then every adapter count under every distribution; the
    16-adapter uniform configuration (the targets' numerator) is always among them."""
    counts = sorted({*counts, BASELINE_ADAPTERS})
    distributions = [d for d in DISTRIBUTIONS if d in {*distributions, BASELINE_DISTRIBUTION}]
    return [Configuration(0, None)] + [Configuration(count, distribution)
                                       for count in counts for distribution in distributions]


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests in the workload (default 128, --quick 16)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: 16 requests with outputs of {QUICK_OUTPUT_LEN.low}-"
                             f"{QUICK_OUTPUT_LEN.high} tokens")
    parser.add_argument("--repeats", type=int, default=1,
                        help="serve every configuration this many times, round-robin, and "
                             "report the fastest (damps other load on the machine)")
    parser.add_argument("--seed", type=int, default=0,
                        help="workload and adapter-assignment seed")
    parser.add_argument("--device", default="cpu", help="torch device for both systems")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads for both systems (default: torch's "
                             "choice); 1 is far steadier when other processes share the CPUs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                        help="engine token budget per step")
    parser.add_argument("--adapters-dir", type=Path, default=None,
                        help="where the bench adapters are written and reused "
                             "(default MODEL/bench-adapters)")
    parser.add_argument("--adapter-counts", type=_int_list, default=list(ADAPTER_COUNTS),
                        help="adapter counts to sweep, comma-separated (16 is always run)")
    parser.add_argument("--distributions", default=",".join(DISTRIBUTIONS),
                        help="adapter popularity, comma-separated: uniform, zipf (uniform is "
                             "always run)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result path")
    args = parser.parse_args(argv)
    args.num_requests = args.num_requests or (16 if args.quick else 128)
    if min(args.num_requests, args.repeats) < 1 or args.threads < 0:
        parser.error("--num-requests and --repeats must be >= 1, --threads >= 0")
    args.distributions = args.distributions.split(",")
    if set(args.distributions) - set(DISTRIBUTIONS) or min(args.adapter_counts,
                                                           default=1) < 1:
        parser.error(f"--distributions must be among {DISTRIBUTIONS}, --adapter-counts >= 1")
    args.configurations = configurations(args.adapter_counts, args.distributions)
    args.output_len = QUICK_OUTPUT_LEN if args.quick else OUTPUT_LEN
    args.adapters_dir = args.adapters_dir or bench_adapters_dir(args.model)
    return args


def serve_all(args: argparse.Namespace, requests: list[BenchRequest], paths: dict[str, Path]
              ) -> tuple[list[list[EngineRun]], list[RunResult]]:
    """Every configuration, then the PEFT baseline, args.repeats rounds; returns all engine
    runs per configuration (in configurations() order) and all baseline runs."""
    configs: list[Configuration] = args.configurations
    engine_runs: list[list[EngineRun]] = [[] for _ in configs]
    baseline_runs: list[RunResult] = []
    baseline_adapters = assign_adapters(len(requests), BASELINE_ADAPTERS,
                                        BASELINE_DISTRIBUTION, args.seed)
    for round_index in range(args.repeats):
        suffix = f" (round {round_index + 1}/{args.repeats})" if args.repeats > 1 else ""
        for config, runs in zip(configs, engine_runs, strict=True):
            print(f"engine, {config.label}{suffix}", flush=True)
            adapters: list[str | None] = (
                list(assign_adapters(len(requests), config.num_adapters, config.distribution,
                                     args.seed))
                if config.distribution is not None else [None] * len(requests))
            run = run_engine(config.label, args.model, requests, adapters, paths,
                             config.num_adapters, config.distribution, args)
            runs.append(run)
            ratio = run.result.output_tokens_per_s / engine_runs[0][-1].result.output_tokens_per_s
            print(f"  {run.result.output_tokens_per_s:.2f} tok/s in {run.result.seconds:.1f}s "
                  f"({ratio:.2f} of this round's reference)", flush=True)
        print(f"PEFT per-adapter batching, {BASELINE_ADAPTERS} adapters, "
              f"{BASELINE_DISTRIBUTION}{suffix}", flush=True)
        baseline_runs.append(run_peft_baseline(args.model, requests, baseline_adapters, paths,
                                               torch.device(args.device), MAX_NUM_SEQS))
    return engine_runs, baseline_runs


def fastest_run(runs: list[EngineRun]) -> EngineRun:
    return min(runs, key=lambda run: run.result.seconds)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # PEFT on HF 5
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    vocab_size = int(AutoConfig.from_pretrained(args.model).vocab_size)
    spec = WorkloadSpec(args.num_requests, PROMPT_LEN, args.output_len, vocab_size, args.seed)
    requests = generate(spec)
    info = {**machine_info(device), "peft": peft.__version__}
    print(f"{len(requests)} requests, {total_output_tokens(requests)} output tokens, "
          f"{sum(r.prompt_len for r in requests)} prompt tokens; {info['cpu_count']} CPUs, "
          f"torch {info['torch']} on {device}, load average {info['load_average_start']}",
          flush=True)
    paths = ensure_adapters(args.model, args.adapters_dir,
                            max(c.num_adapters for c in args.configurations))

    engine_runs, baseline_runs = serve_all(args, requests, paths)
    runs = [fastest_run(r) for r in engine_runs]
    baseline = min(baseline_runs, key=lambda r: r.seconds)
    print_table(runs, baseline)
    ratios = target_ratios(runs, baseline)
    print_targets(ratios)

    info["load_average_end"] = os.getloadavg()
    write_json(args.output, {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.lora_throughput " + " ".join(argv or sys.argv[1:]),
        "machine": info,
        "workload": {"kind": "mixed", "num_requests": len(requests), "seed": args.seed,
                     "prompt_len": [PROMPT_LEN.low, PROMPT_LEN.high],
                     "output_len": [args.output_len.low, args.output_len.high],
                     "prompt_tokens": sum(r.prompt_len for r in requests),
                     "output_tokens": total_output_tokens(requests),
                     "zipf_s": ZIPF_S, "quick": args.quick},
        "engine_config": {"max_loras": MAX_LORAS, "max_cpu_loras": MAX_CPU_LORAS,
                          "max_lora_rank": MAX_LORA_RANK, "max_num_seqs": MAX_NUM_SEQS,
                          "max_num_batched_tokens": args.max_num_batched_tokens,
                          "reference_max_loras": 0},
        "adapters": {"dir": str(args.adapters_dir), "ranks": "8 (even index), 16 (odd)",
                     "target_modules": list(SUPPORTED_MODULES), "b_scale": ADAPTER_B_SCALE,
                     "seed": ADAPTER_SEED},
        "repeats": args.repeats,
        "engine_runs": [run.to_json() for run in runs],
        "peft_baseline": {**baseline.to_json(), "num_adapters": BASELINE_ADAPTERS,
                          "distribution": BASELINE_DISTRIBUTION, "max_batch": MAX_NUM_SEQS},
        "all_engine_seconds": {r[0].label: [run.result.seconds for run in r]
                               for r in engine_runs},
        "all_peft_seconds": [r.seconds for r in baseline_runs],
        "ratios": ratios,
        "targets": {"lora16_over_peft": BASELINE_TARGET, "lora16_over_base": BASE_RATIO_TARGET},
    })


if __name__ == "__main__":
    main()
