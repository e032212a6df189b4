"""The engine side of the multi-LoRA throughput benchmark: its configuration, and one
configuration served on a fresh engine and timed, with what its steps looked like."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench_adapters import adapter_name
from benchmarks.throughput import PHASES, RunResult, warmup_requests
from benchmarks.workloads import BenchRequest, total_output_tokens
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

MAX_LORAS = 16
MAX_CPU_LORAS = 64
MAX_LORA_RANK = 16
MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class EngineRun:
    """One engine configuration serving the workload, and what its steps looked like."""

    label: str
    num_adapters: int
    distribution: str | None
    distinct_adapters_used: int
    result: RunResult
    num_steps: int
    mean_requests_per_step: float
    """Requests that got a token per step: the effective decode batch."""
    slot_loads: int
    """Adapter copies into device slots (first uses plus reloads after eviction)."""
    phase_ms_per_step: dict[str, float]
    load_average: tuple[float, float]
    """1-minute load average at the start and at the end of the timed run."""

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "result"},
                **self.result.to_json()}


def make_engine(model_dir: str, device: str, max_loras: int,
                max_num_batched_tokens: int) -> LLMEngine:
    return LLMEngine.from_model(model_dir, dtype="float32", device=device,
                                max_num_seqs=MAX_NUM_SEQS,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_loras=max_loras, max_cpu_loras=MAX_CPU_LORAS,
                                max_lora_rank=MAX_LORA_RANK)


def add_all(engine: LLMEngine, requests: Sequence[BenchRequest],
            adapters: Sequence[str | None], prefix: str) -> None:
    for i, (r, lora) in enumerate(zip(requests, adapters, strict=True)):
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{prefix}-{i}", list(r.prompt_token_ids), params, lora=lora)


def drain(engine: LLMEngine) -> tuple[int, int]:
    """Step until every request is finished; returns (output tokens of the finished
    requests, requests that got a token summed over steps)."""
    tokens = served = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        served += len(outputs)
        tokens += sum(len(out.token_ids) for out in outputs if out.finished)
    return tokens, served


def run_engine(label: str, model_dir: str, requests: list[BenchRequest],
               adapters: list[str | None], paths: dict[str, Path], num_adapters: int,
               distribution: str | None, args: argparse.Namespace) -> EngineRun:
    """Serve the workload on a fresh engine; adapters[i] is request i's adapter or None.

    All num_adapters adapters are registered (only the used ones are ever scheduled); the
    warm-up request uses bench-0 so the LoRA path is warm too."""
    engine = make_engine(model_dir, args.device, MAX_LORAS if num_adapters else 0,
                         args.max_num_batched_tokens)
    try:
        for index in range(num_adapters):
            engine.load_lora(adapter_name(index), str(paths[adapter_name(index)]))
        warm = warmup_requests(engine.model_shape.vocab_size)[:1]
        add_all(engine, warm, [adapter_name(0) if num_adapters else None], "warmup")
        drain(engine)
        stats = engine.stats()
        phases_before, steps_before = dict(stats.phase_seconds), stats.num_steps
        loads_before = engine.lora.num_slot_loads if engine.lora is not None else 0
        load_start = os.getloadavg()[0]
        start, cpu_start = time.perf_counter(), time.process_time()
        add_all(engine, requests, adapters, "req")
        tokens, served = drain(engine)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        load_end = os.getloadavg()[0]
        expected = total_output_tokens(requests)
        assert tokens == expected, f"engine produced {tokens} tokens, expected {expected}"
        stats = engine.stats()
        steps = stats.num_steps - steps_before
        phases = {p: 1e3 * (stats.phase_seconds[p] - phases_before[p]) / steps for p in PHASES}
        loads = (engine.lora.num_slot_loads if engine.lora is not None else 0) - loads_before
    finally:
        if engine.lora is not None:
            engine.lora.shutdown()
    used = len({a for a in adapters if a is not None})
    result = RunResult(label, len(requests), tokens, seconds, cpu_seconds)
    return EngineRun(label, num_adapters, distribution, used, result, steps, served / steps,
                     loads, phases, (load_start, load_end))
