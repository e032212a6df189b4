"""Engine throughput vs transformers static batching, and the engine's per-step overhead.

    python -m benchmarks.throughput --model DIR [--num-requests 200] [--max-batch 64] [--quick]

Part 1 runs one seeded mixed workload (prompts 32-512, outputs 16-256 tokens) twice:
(a) transformers ``model.generate`` over static batches of at most B requests, left-padded,
greedy, each batch generating its longest member's output length; (b) LLMEngine with
max_num_seqs=B, every request added at once and stepped until done. Both count only the
tokens each request asked for, so a static batch's padding and over-generation are its cost.

Part 2 keeps 64 requests in the decode phase and reports the share of step time spent
outside the model forward (scheduling, input preparation, sampling, outputs).

Results are printed and written as JSON (default benchmarks/results/throughput.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from benchmarks.workloads import (
    BenchRequest,
    LengthRange,
    WorkloadSpec,
    decode_heavy_workload,
    generate,
    mixed_workload,
    total_output_tokens,
)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import StepTiming
from engine.sampling_params import SamplingParams

PHASES = ("schedule", "prepare", "forward", "sample", "output")
DEFAULT_OUTPUT = Path(__file__).parent / "results" / "throughput.json"
THROUGHPUT_TARGET = 2.0
OVERHEAD_TARGET = 0.15
OVERHEAD_BATCH = 64


@dataclass(frozen=True)
class RunResult:
    """Wall-clock outcome of one system serving the whole workload."""

    name: str
    num_requests: int
    output_tokens: int
    seconds: float
    cpu_seconds: float
    """Process CPU time (all threads): less sensitive than wall time to other load."""

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "requests_per_s": self.requests_per_s,
                "output_tokens_per_s": self.output_tokens_per_s}


@dataclass
class OverheadResult:
    """Per-step phase times of decode-phase steps with OVERHEAD_BATCH requests running."""

    num_running: int
    steps: list[StepTiming] = field(default_factory=list)

    @property
    def outside_forward_share(self) -> float:
        """Mean over steps of outside_forward / total."""
        return sum(s.outside_forward / s.total for s in self.steps) / len(self.steps)

    def mean_ms(self) -> dict[str, float]:
        return {p: 1e3 * sum(getattr(s, p) for s in self.steps) / len(self.steps)
                for p in PHASES}

    def to_json(self) -> dict[str, Any]:
        return {"num_running": self.num_running, "num_steps": len(self.steps),
                "outside_forward_share": self.outside_forward_share,
                "phase_ms_per_step": self.mean_ms()}


def warmup_requests(vocab_size: int) -> list[BenchRequest]:
    """Two short requests whose prompts share nothing with the measured workload, so the
    warm-up leaves nothing in the engine's prefix cache that the measured run could reuse."""
    spec = WorkloadSpec(2, LengthRange(32, 64), LengthRange(4, 8), vocab_size, seed=-1)
    return generate(spec)


# --------------------------------------------------------------------------- transformers
def load_hf_model(model_dir: str, device: torch.device) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model_dir,
                                                                  dtype=torch.float32)
    model.to(device)  # type: ignore[arg-type]  # transformers' stubs mistype .to
    return model.eval()


def left_pad(batch: list[BenchRequest], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, longest prompt] input ids left-padded with pad_id, and the matching attention
    mask (1 = real token)."""
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
        mask[row, width - r.prompt_len:] = 1
    return ids.to(device), mask.to(device)


def hf_generate_batch(model: PreTrainedModel, batch: list[BenchRequest], pad_id: int) -> None:
    """Greedy generation of the whole batch up to its longest output (EOS suppressed)."""
    ids, mask = left_pad(batch, pad_id, model.device)
    new_tokens = max(r.output_len for r in batch)
    out = model.generate(  # type: ignore[operator]  # transformers' stubs mistype generate
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, pad_token_id=pad_id)
    assert out.shape == (len(batch), ids.shape[1] + new_tokens), out.shape


def run_hf(model_dir: str, requests: list[BenchRequest], max_batch: int,
           device: torch.device) -> RunResult:
    model = load_hf_model(model_dir, device)
    pad_id = int(model.config.pad_token_id)
    batches = [requests[i:i + max_batch] for i in range(0, len(requests), max_batch)]
    with torch.inference_mode():
        hf_generate_batch(model, warmup_requests(model.config.vocab_size), pad_id)  # untimed
        start, cpu_start = time.perf_counter(), time.process_time()
        for number, batch in enumerate(batches, 1):
            hf_generate_batch(model, batch, pad_id)
            print(f"  hf batch {number}/{len(batches)} done "
                  f"({time.perf_counter() - start:.1f}s)", flush=True)
        seconds = time.perf_counter() - start
    return RunResult("transformers static batching", len(requests),
                     total_output_tokens(requests), seconds, time.process_time() - cpu_start)


# --------------------------------------------------------------------------------- engine
def make_engine(model_dir: str, max_num_seqs: int, device: str,
                max_num_batched_tokens: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, max_num_seqs=max_num_seqs, dtype="float32",
                                  device=device,
                                  max_num_batched_tokens=max_num_batched_tokens))


def add_all(engine: LLMEngine, requests: list[BenchRequest], prefix: str) -> None:
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{prefix}-{i}", list(r.prompt_token_ids), params)


def drain(engine: LLMEngine) -> int:
    """Step until every request is finished; returns the output tokens of all of them."""
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(out.token_ids) for out in engine.step() if out.finished)
    return tokens


def phase_seconds(engine: LLMEngine) -> dict[str, float]:
    return dict(engine.stats().phase_seconds)


def run_engine(engine: LLMEngine, requests: list[BenchRequest]
               ) -> tuple[RunResult, dict[str, float]]:
    """Serve the workload; returns the result and the ms per step of each phase."""
    add_all(engine, warmup_requests(engine.model_shape.vocab_size), "warmup")
    drain(engine)
    before, steps_before = phase_seconds(engine), engine.stats().num_steps
    start, cpu_start = time.perf_counter(), time.process_time()
    add_all(engine, requests, "req")
    tokens = drain(engine)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    expected = total_output_tokens(requests)
    assert tokens == expected, f"engine produced {tokens} tokens, expected {expected}"
    after, steps = phase_seconds(engine), engine.stats().num_steps - steps_before
    breakdown = {p: 1e3 * (after[p] - before[p]) / steps for p in PHASES}
    return RunResult("loragate engine", len(requests), tokens, seconds, cpu_seconds), breakdown


def is_decode_step(engine: LLMEngine, computed_before: int, num_running: int) -> bool:
    """True when the last step ran num_running requests and no prompt token."""
    stats = engine.stats()
    return stats.num_running == num_running and stats.prompt_tokens_computed == computed_before


def measure_overhead(engine: LLMEngine, vocab_size: int, warmup_steps: int,
                     steps: int) -> OverheadResult:
    """Run OVERHEAD_BATCH decode-phase requests; time `steps` steps after `warmup_steps`."""
    output_len = 2 * (warmup_steps + steps) + 64  # never finishes while we measure
    add_all(engine, generate(decode_heavy_workload(OVERHEAD_BATCH, vocab_size,
                                                   output_len=output_len, seed=1)), "decode")
    result = OverheadResult(OVERHEAD_BATCH)
    seen = 0
    while len(result.steps) < steps:
        if not engine.has_unfinished_requests():
            raise RuntimeError("requests finished before enough decode steps were measured")
        computed = engine.stats().prompt_tokens_computed
        engine.step()
        if not is_decode_step(engine, computed, OVERHEAD_BATCH):
            continue
        seen += 1
        if seen > warmup_steps:
            assert engine.metrics.last_step is not None
            result.steps.append(engine.metrics.last_step)
    return result


# ---------------------------------------------------------------------------------- report
def machine_info(device: torch.device) -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "dtype": "float32",
        "load_average_start": os.getloadavg(),
    }


def print_table(hf: RunResult, engine: RunResult) -> None:
    rows = [("requests/s", hf.requests_per_s, engine.requests_per_s),
            ("output tokens/s", hf.output_tokens_per_s, engine.output_tokens_per_s),
            ("total seconds", hf.seconds, engine.seconds)]
    print(f"\n{'metric':<18}{'(a) transformers':>18}{'(b) engine':>14}{'b/a':>8}")
    for name, a, b in rows:
        print(f"{name:<18}{a:>18.2f}{b:>14.2f}{b / a:>8.2f}")
    ratio = engine.output_tokens_per_s / hf.output_tokens_per_s
    verdict = "PASS" if ratio >= THROUGHPUT_TARGET else "FAIL"
    print(f"throughput ratio b/a = {ratio:.2f} (target >= {THROUGHPUT_TARGET}) {verdict}; "
          f"by process CPU time {hf.cpu_seconds / engine.cpu_seconds:.2f}")


def print_phases(title: str, ms: dict[str, float]) -> None:
    total = sum(ms.values())
    parts = "  ".join(f"{p} {ms[p]:.2f}" for p in PHASES)
    print(f"{title}: {parts}  (total {total:.2f} ms/step)")


def print_overhead(overhead: OverheadResult) -> None:
    share = overhead.outside_forward_share
    verdict = "PASS" if share <= OVERHEAD_TARGET else "FAIL"
    print(f"\noutside-forward share at {overhead.num_running} running decodes, "
          f"{len(overhead.steps)} steps: {share:.1%} (target <= {OVERHEAD_TARGET:.0%}) "
          f"{verdict}")
    print_phases("decode step phases, ms", overhead.mean_ms())


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")


# ------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests in the mixed workload (default 200, --quick 32)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="static batch size B = engine max_num_seqs (default 64, --quick 16)")
    parser.add_argument("--quick", action="store_true",
                        help="small run (32 requests, B=16, 10 overhead steps)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--device", default="cpu", help="torch device for both systems")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                        help="engine token budget per step")
    parser.add_argument("--overhead-steps", type=int, default=None,
                        help="decode steps averaged for the overhead share (default 20)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result path")
    args = parser.parse_args(argv)
    quick = args.quick
    args.num_requests = args.num_requests or (32 if quick else 200)
    args.max_batch = args.max_batch or (16 if quick else 64)
    args.overhead_steps = args.overhead_steps or (10 if quick else 20)
    args.warmup_steps = 3 if quick else 5
    if min(args.num_requests, args.max_batch, args.overhead_steps) < 1:
        parser.error("--num-requests, --max-batch and --overhead-steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    vocab_size = int(AutoConfig.from_pretrained(args.model).vocab_size)
    requests = generate(mixed_workload(args.num_requests, vocab_size, args.seed))
    info = machine_info(device)
    print(f"{len(requests)} requests, B={args.max_batch}, "
          f"{total_output_tokens(requests)} output tokens, "
          f"{sum(r.prompt_len for r in requests)} prompt tokens; {info['cpu_count']} CPUs, "
          f"torch {info['torch']} on {device}", flush=True)

    print("(a) transformers static batching", flush=True)
    hf = run_hf(args.model, requests, args.max_batch, device)
    print("(b) loragate engine", flush=True)
    engine = make_engine(args.model, args.max_batch, args.device, args.max_num_batched_tokens)
    eng, run_phases = run_engine(engine, requests)
    del engine
    print_table(hf, eng)
    print_phases("engine run phases, ms", run_phases)

    print(f"\nmeasuring per-step overhead with {OVERHEAD_BATCH} decodes", flush=True)
    engine = make_engine(args.model, OVERHEAD_BATCH, args.device, args.max_num_batched_tokens)
    overhead = measure_overhead(engine, vocab_size, args.warmup_steps, args.overhead_steps)
    print_overhead(overhead)

    info["load_average_end"] = os.getloadavg()
    write_json(args.output, {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": info,
        "workload": {"kind": "mixed", "num_requests": len(requests), "seed": args.seed,
                     "prompt_len": [32, 512], "output_len": [16, 256],
                     "prompt_tokens": sum(r.prompt_len for r in requests),
                     "output_tokens": total_output_tokens(requests)},
        "max_batch": args.max_batch,
        "engine_max_num_batched_tokens": args.max_num_batched_tokens,
        "transformers": hf.to_json(),
        "engine": eng.to_json(),
        "engine_phase_ms_per_step": run_phases,
        "throughput_ratio": eng.output_tokens_per_s / hf.output_tokens_per_s,
        "cpu_time_ratio": hf.cpu_seconds / eng.cpu_seconds,
        "throughput_target": THROUGHPUT_TARGET,
        "overhead": overhead.to_json(),
        "overhead_target": OVERHEAD_TARGET,
    })


if __name__ == "__main__":
    main()
