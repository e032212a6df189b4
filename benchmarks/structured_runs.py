"""The structured-outputs benchmark's engine runs: a batch stepped by hand with each step's
timing kept, the constrained-against-plain masking measurement, grammar compile times, the
count of tokens sampled outside their grammar, and the warm-up."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from benchmarks.structured_schemas import Job, SchemaCase
from benchmarks.structured_validity import check_outputs
from engine.invalid_field import InvalidField
from engine.llm_engine import LLMEngine
from engine.metrics import StepTiming
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarCompiler, StructuredOutput


@dataclass(frozen=True)
class StepRecord:
    """One engine step: how many rows sampled a token, prefill tokens computed, timing."""

    rows: int
    prefill_tokens: int
    timing: StepTiming
    cpu_s: float
    """The process's CPU time (all threads) in the step: what the step cost, whatever
    else ran on the host, where the phase timings are wall time."""


@dataclass
class BatchRun:
    outputs: list[RequestOutput]
    steps: list[StepRecord]
    wall_s: float
    preemptions: int

    @property
    def output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def run_batch(engine: LLMEngine, prompts: Sequence[list[int]],
              params: Sequence[SamplingParams], tag: str) -> BatchRun:
    """Add every request at once and step until all are done (LLM.generate's loop), with
    each step's timing and batch rows kept; the outputs come back in prompt order."""
    start = time.perf_counter()
    preempted = engine.stats().num_preemptions
    # make_request compiles a schema the engine has not seen: part of the wall time, as
    # it is in LLM.generate.
    requests = [engine.requests.make_request(f"{tag}-{i}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    order = {r.request_id: i for i, r in enumerate(requests)}
    for request in requests:
        engine.add(request)
    metrics = engine.metrics
    results: list[RequestOutput | None] = [None] * len(requests)
    steps: list[StepRecord] = []
    while engine.has_unfinished_requests():
        before = (metrics.num_steps, metrics.generation_tokens, metrics.prompt_tokens_computed)
        cpu = time.process_time()
        for out in engine.step():
            if out.finished:
                results[order[out.request_id]] = out
        cpu = time.process_time() - cpu
        if metrics.num_steps == before[0] or metrics.last_step is None:
            continue  # an idle step (nothing scheduled) records no timing
        steps.append(StepRecord(rows=metrics.generation_tokens - before[1],
                                prefill_tokens=metrics.prompt_tokens_computed - before[2],
                                timing=metrics.last_step, cpu_s=cpu))
    wall = time.perf_counter() - start
    done = [r for r in results if r is not None]
    assert len(done) == len(results), "a request never finished"
    return BatchRun(done, steps, wall, engine.stats().num_preemptions - preempted)


@dataclass(frozen=True)
class StepSummary:
    """Phase times of a set of steps, per step and per sampled token. Medians: on a shared
    host another process's burst makes a few steps many times slower, which a mean carries
    into the comparison (the means are kept beside them)."""

    steps: int
    tokens: int
    mean_rows: float
    sample_ms_per_step: float
    forward_ms_per_step: float
    outside_forward_ms_per_step: float
    """Schedule, prepare, sample and output: where the constraint's work falls."""
    step_ms_per_step: float
    cpu_ms_per_step: float
    """The process's CPU time per step (StepRecord.cpu_s)."""
    sample_us_per_token: float
    """Median over the steps of the step's sample time / its rows."""
    step_us_per_token: float
    sample_ms_per_step_mean: float
    step_ms_per_step_mean: float

    @classmethod
    def of(cls, steps: Sequence[StepRecord]) -> StepSummary:
        steps = [s for s in steps if s.rows > 0]
        if not steps:
            return cls(0, 0, *(math.nan,) * 10)
        tokens = sum(s.rows for s in steps)
        median = statistics.median
        return cls(
            steps=len(steps), tokens=tokens, mean_rows=tokens / len(steps),
            sample_ms_per_step=1e3 * median(s.timing.sample for s in steps),
            forward_ms_per_step=1e3 * median(s.timing.forward for s in steps),
            outside_forward_ms_per_step=1e3 * median(s.timing.outside_forward for s in steps),
            step_ms_per_step=1e3 * median(s.timing.total for s in steps),
            cpu_ms_per_step=1e3 * median(s.cpu_s for s in steps),
            sample_us_per_token=1e6 * median(s.timing.sample / s.rows for s in steps),
            step_us_per_token=1e6 * median(s.timing.total / s.rows for s in steps),
            sample_ms_per_step_mean=1e3 * statistics.fmean(s.timing.sample for s in steps),
            step_ms_per_step_mean=1e3 * statistics.fmean(s.timing.total for s in steps))


def decode_steps(steps: Sequence[StepRecord]) -> list[StepRecord]:
    """Steps without a prefill chunk: their cost is the decode batch's alone."""
    return [s for s in steps if s.prefill_tokens == 0 and s.rows > 0]


@dataclass
class MaskingResult:
    """The A (constrained) and B (plain, the same lengths) runs' decode-step figures, and
    the steps paired one to one where the two runs' schedules matched."""

    requests: int
    repeats: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[str, list[StepRecord]] = field(
        default_factory=lambda: {"constrained": [], "plain": []})
    pairs: list[tuple[StepRecord, StepRecord]] = field(default_factory=list)

    def summary(self, arm: str) -> StepSummary:
        return StepSummary.of(decode_steps(self.steps[arm]))

    def paired(self) -> dict[str, float]:
        """What the constraint adds to a step, over the paired decode steps (same rows,
        same contexts): per decoded token (the summed time difference over the summed
        rows, and the summed step times' ratio), and at full batch (the pairs with the
        most rows: medians of the differences, with the plain step's time beside them)."""
        if not self.pairs:
            return {"pairs": 0}
        median = statistics.median
        rows = sum(a.rows for a, _ in self.pairs)
        top = max(a.rows for a, _ in self.pairs)
        full = [(a, b) for a, b in self.pairs if a.rows == top]

        def total(phase: str, arm: int) -> float:
            return sum(getattr(pair[arm].timing, phase) for pair in self.pairs)

        return {
            "pairs": len(self.pairs),
            "sample_us_added_per_token": 1e6 * (total("sample", 0) - total("sample", 1)) / rows,
            "step_us_added_per_token": 1e6 * (total("total", 0) - total("total", 1)) / rows,
            "step_time_ratio": total("total", 0) / total("total", 1),
            "forward_time_ratio": total("forward", 0) / total("forward", 1),
            "median_sample_ms_added": 1e3 * median(a.timing.sample - b.timing.sample
                                                   for a, b in self.pairs),
            "median_step_ms_added": 1e3 * median(a.timing.total - b.timing.total
                                                 for a, b in self.pairs),
            "median_step_ratio": median(a.timing.total / b.timing.total
                                        for a, b in self.pairs),
            "median_forward_ratio": median(a.timing.forward / b.timing.forward
                                           for a, b in self.pairs),
            "full_batch_rows": top,
            "full_batch_pairs": len(full),
            "full_batch_sample_ms_added": 1e3 * median(a.timing.sample - b.timing.sample
                                                       for a, b in full),
            "full_batch_step_ms_added": 1e3 * median(a.timing.total - b.timing.total
                                                     for a, b in full),
            "full_batch_plain_step_ms": 1e3 * median(b.timing.total for _, b in full),
            "full_batch_step_ratio": median(a.timing.total / b.timing.total for a, b in full)}

    def ratios(self) -> dict[str, float]:
        """Constrained over plain, of the per-step and per-token medians.
        ``forward_per_step`` is the host check: the same work in both arms, so far from 1
        means the host's load changed between the runs."""
        a, b = self.summary("constrained"), self.summary("plain")
        return {"sample_per_step": a.sample_ms_per_step / b.sample_ms_per_step,
                "step_per_step": a.step_ms_per_step / b.step_ms_per_step,
                "forward_per_step": a.forward_ms_per_step / b.forward_ms_per_step,
                "outside_forward_per_step":
                    a.outside_forward_ms_per_step / b.outside_forward_ms_per_step,
                "cpu_per_step": a.cpu_ms_per_step / b.cpu_ms_per_step,
                "sample_per_token": a.sample_us_per_token / b.sample_us_per_token,
                "step_per_token": a.step_us_per_token / b.step_us_per_token}

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "repeats": self.repeats,
                "ratios": self.ratios(), "paired": self.paired(),
                "decode_steps": {a: asdict(self.summary(a)) for a in self.steps},
                "runs": self.runs}


def measure_masking(engine: LLMEngine, jobs: Sequence[Job], repeats: int,
                    backend: str) -> MaskingResult:
    """Constrained and plain runs of ``jobs``, alternating A B A B so that a drift of the
    host (other load, thermal) falls on both arms alike.

    Each plain request generates exactly as many tokens as its constrained run did
    (max_tokens = that length, ignore_eos): both runs then decode the same tokens in the
    same batches over the same contexts, so their steps differ only by the constraint's
    work and pair up one to one. Left to end on their own, plain outputs run longer, and
    their longer contexts make a slower forward that is no cost of the masking."""
    result = MaskingResult(len(jobs), repeats)
    prompts = [j.prompt for j in jobs]
    for repeat in range(repeats):
        constrained = run_batch(engine, prompts, [j.params for j in jobs],
                                f"mask-constrained-{repeat}")
        plain = run_batch(engine, prompts, [
            replace(j.plain(), max_tokens=len(out.token_ids), ignore_eos=True)
            for j, out in zip(jobs, constrained.outputs, strict=True)], f"mask-plain-{repeat}")
        a, b = decode_steps(constrained.steps), decode_steps(plain.steps)
        # The scheduler is deterministic: the same requests of the same lengths give the
        # same steps. Should they differ, the runs are still compared as two sets.
        matched = [(x.rows, x.prefill_tokens) for x in constrained.steps] == \
            [(y.rows, y.prefill_tokens) for y in plain.steps]
        if matched:
            result.pairs.extend(zip(a, b, strict=True))
        for arm, run in (("constrained", constrained), ("plain", plain)):
            result.steps[arm].extend(run.steps)
            entry: dict[str, Any] = {
                "arm": arm, "repeat": repeat, "wall_s": run.wall_s,
                "output_tokens": run.output_tokens, "steps": len(run.steps),
                "schedules_matched": matched, "preemptions": run.preemptions,
                "decode": asdict(StepSummary.of(decode_steps(run.steps)))}
            if arm == "constrained":  # more outputs to validate, for free
                entry["validity"] = asdict(check_outputs(jobs, run.outputs, backend).total)
            result.runs.append(entry)
    return result


@dataclass(frozen=True)
class CompileTimes:
    """Seconds of a fresh compiler's set-up, and each schema's first and cached compile;
    ``bounded_*``: the same with the engine's compile-time bound (each new schema timed in
    the helper process first; its first compile there includes starting the helper)."""

    setup_s: float
    first_s: dict[str, float]
    cached_s: dict[str, float]
    bounded_timeout_s: float
    bounded_helper_start_s: float
    bounded_first_s: dict[str, float]
    refused_after_s: float
    """How long a spec past the bound (SLOW_SPEC) held its caller before the 400."""
    next_after_refusal_s: float
    """The next new spec's compile, the helper's restart included."""


SLOW_SPEC = StructuredOutput("json", '{"type": "string", "pattern": "[a-z]{1,20000}"}')
"""30 characters of schema whose compile takes about a minute on one core."""


def measure_compile(engine: LLMEngine, cases: Sequence[SchemaCase],
                    timeout_s: float | None = None) -> CompileTimes:
    """Compile every schema with compilers of their own, as the engine's is built (the
    engine's one has compiled them already once it has run, so it could not show the
    first compile): unbounded, then with the compile-time bound (``timeout_s``, else the
    engine's), and how the bound answers SLOW_SPEC."""
    start = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, engine.model_shape.vocab_size,
                               engine.eos_token_ids)
    setup = time.perf_counter() - start
    first: dict[str, float] = {}
    cached: dict[str, float] = {}
    for case in cases:
        for times in (first, cached):
            start = time.perf_counter()
            compiler.compile(case.structured)
            times[case.name] = time.perf_counter() - start
    timeout = timeout_s or engine.config.grammar_compile_timeout_s or 10.0
    bounded = GrammarCompiler(engine.tokenizer, engine.model_shape.vocab_size,
                              engine.eos_token_ids, timeout)
    bounded_first: dict[str, float] = {}
    try:
        start = time.perf_counter()
        bounded.compile(StructuredOutput("regex", "[0-9]"))  # starts the helper process
        helper = time.perf_counter() - start
        for case in cases:
            start = time.perf_counter()
            bounded.compile(case.structured)
            bounded_first[case.name] = time.perf_counter() - start
        start = time.perf_counter()
        try:
            bounded.compile(SLOW_SPEC)
            raise AssertionError("a spec past the bound compiled")
        except InvalidField:
            refused = time.perf_counter() - start
        start = time.perf_counter()
        bounded.compile(StructuredOutput("regex", "[0-9]{2}"))
        after = time.perf_counter() - start
    finally:
        bounded.close()
    return CompileTimes(setup, first, cached, timeout, helper, bounded_first, refused, after)


class RejectionCounter(logging.Handler):
    """Counts the runner's "token is outside its grammar" warnings: a sampled token the
    mask should have made impossible."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "outside its grammar" in record.getMessage():
            self.count += 1
            if len(self.first) < 10:
                self.first.append(record.getMessage())


def warm_up(engine: LLMEngine, jobs: Sequence[Job]) -> None:
    """A short constrained and plain batch first: the CPU kernels are built or loaded and
    the allocator settles before anything is timed. Its prompts are the workload's, so
    the prefix cache starts as warm for the timed runs as it is in steady serving."""
    few = list(jobs[:8])
    prompts = [j.prompt for j in few]
    params = [replace(j.params, max_tokens=8) for j in few]
    run_batch(engine, prompts, params, "warm-constrained")
    run_batch(engine, prompts, [replace(p, structured=None) for p in params], "warm-plain")
