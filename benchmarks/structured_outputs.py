"""Structured outputs under load: does every JSON-schema-constrained output validate, and
what does the token masking cost per engine step?

    python -m benchmarks.structured_outputs [--requests 1000] [--out FILE] [--model DIR]
        [--max-tokens 160] [--max-num-seqs 64] [--mask-requests 128] [--mask-repeats 2]
        [--threads 2]

Eight realistic JSON schemas (a person, a postal address, a catalogue product, a calendar
event, a yes/no review classification, a nested order, a support ticket, a recipe; every
string bounded by maxLength or a pattern and every array by maxItems, so a valid output
ends), each with chat prompts that ask for that JSON (the schema is in the prompt, rendered
with the tokenizer's chat template). The model defaults to SmolLM2-135M-Instruct in float32
(fetched and converted once, as engine.default_model does it).

1. Validity: ``--requests`` requests, round-robin over the schemas, temperature 0.8 with a
   seed per request, all added at once to one engine (max_num_seqs 64) and stepped until
   done, as LLM.generate does (by hand here, to time each step). Every output that ended
   with finish_reason "stop" must parse with json.loads and validate against its schema
   (the ``jsonschema`` package when importable, else ``jsonschema_rs``, and beside either
   this module's validator of the keywords the schemas use). Target: 0 invalid; outputs
   cut at max_tokens ("length") are counted apart, with how many of them already hold a
   complete valid object (only the end-of-sequence token was missing). The engine's
   warnings that a sampled token was outside its grammar (a failed mask) are counted too.
2. Masking cost: the first ``--mask-requests`` of those requests run again, constrained (A)
   and plain (B: the same prompts and seeds without the constraint), alternating A B A B.
   Left to end on their own, plain outputs run longer than constrained ones, and longer
   contexts make a slower forward pass that is no cost of the masking; so each plain
   request generates exactly as many tokens as its constrained run did (max_tokens = that
   length with ignore_eos, which only a request without a constraint may set). Both arms
   then decode the same tokens in the same batches and their steps pair up one to one.
   The figures are engine.metrics' phase timings of the decode-only steps (no prefill
   chunk): the sample phase (logit adjustments, the grammar's bitmask fill and apply,
   sampling, the matchers' advance), the step outside the forward pass, and the whole
   step, as medians per step and per decoded token, and what the constraint adds to a
   paired step. The forward pass is the same work in both arms: its ratio, 1 on a quiet
   host, shows how far another process's load moved the comparison.
3. Compile time: each schema compiled by a fresh GrammarCompiler of the engine's tokenizer
   (first compile, then the cached lookup a repeated schema gets), and the compiler's own
   set-up (reading the vocabulary, once per engine); then the same first compiles with the
   engine's compile-time bound (each new spec timed in a helper process first: its start,
   and what that adds), how long a 30-character schema past the bound holds its caller
   before the 400, and the next new spec's compile after it (the helper restarted).

Prints a table and writes a JSON summary (default benchmarks/results/structured_outputs.json)
with the invalid outputs in full (schema, seed, text, errors) so that each can be replayed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.structured_runs import (
    BatchRun,
    CompileTimes,
    MaskingResult,
    RejectionCounter,
    StepSummary,
    decode_steps,
    measure_compile,
    measure_masking,
    run_batch,
    warm_up,
)
from benchmarks.structured_schemas import make_jobs, schema_cases
from benchmarks.structured_validity import Validity, check_outputs, validator_backend
from engine.default_model import ensure_default_model, loragate_home
from engine.llm import LLM

DEFAULT_OUT = Path(__file__).parent / "results" / "structured_outputs.json"


# ----------------------------------------------------------------------------- report
def print_report(model: str, args: argparse.Namespace, main: BatchRun, validity: Validity,
                 masking: MaskingResult, compiled: CompileTimes) -> None:
    t = validity.total
    print(f"\nstructured outputs: {Path(model).name}, {t.requests} requests over "
          f"{len(validity.per_schema)} schemas, max_num_seqs {args.max_num_seqs}, max_tokens "
          f"{args.max_tokens}, temperature {args.temperature}, validator {validity.backend}")
    print(f"{'schema':10s} {'requests':>8s} {'stop':>6s} {'length':>6s} {'valid':>6s} "
          f"{'invalid':>7s} {'len+valid':>9s} {'tokens/req':>10s}")
    for name, c in [*validity.per_schema.items(), ("total", t)]:
        print(f"{name:10s} {c.requests:8d} {c.stop:6d} {c.length:6d} {c.valid:6d} "
              f"{c.invalid:7d} {c.length_complete:9d} {c.output_tokens / c.requests:10.1f}")
    if t.other:
        print(f"other finish reasons: {t.other}")
    print(f"wall {main.wall_s:.1f} s, {main.output_tokens} output tokens, "
          f"{main.output_tokens / main.wall_s:.1f} tokens/s, "
          f"{len(main.outputs) / main.wall_s:.2f} requests/s, {len(main.steps)} steps, "
          f"{main.preemptions} preemptions")

    a, b = masking.summary("constrained"), masking.summary("plain")
    ratios, paired = masking.ratios(), masking.paired()
    print(f"\nmasking cost: {masking.requests} requests, {masking.repeats} repeats per arm "
          f"(A B A B), plain outputs as long as the constrained ones; medians over the "
          f"decode steps")
    print(f"{'':24s} {'constrained':>11s} {'plain':>9s} {'ratio':>7s}")
    rows = (("decode steps", a.steps, b.steps, None),
            ("mean rows per step", a.mean_rows, b.mean_rows, None),
            ("sample ms / step", a.sample_ms_per_step, b.sample_ms_per_step,
             ratios["sample_per_step"]),
            ("outside forward ms / step", a.outside_forward_ms_per_step,
             b.outside_forward_ms_per_step, ratios["outside_forward_per_step"]),
            ("forward ms / step", a.forward_ms_per_step, b.forward_ms_per_step,
             ratios["forward_per_step"]),
            ("step ms / step", a.step_ms_per_step, b.step_ms_per_step, ratios["step_per_step"]),
            ("step CPU ms / step", a.cpu_ms_per_step, b.cpu_ms_per_step,
             ratios["cpu_per_step"]),
            ("sample us / token", a.sample_us_per_token, b.sample_us_per_token,
             ratios["sample_per_token"]),
            ("step us / token", a.step_us_per_token, b.step_us_per_token,
             ratios["step_per_token"]))
    for label, x, y, ratio in rows:
        shown = f"{ratio:6.2f}x" if ratio is not None else ""
        print(f"{label:24s} {x:11.2f} {y:9.2f} {shown:>7s}")
    if paired["pairs"]:
        print(f"paired decode steps ({paired['pairs']:.0f}): the constraint adds "
              f"{paired['sample_us_added_per_token']:.0f} us of sample phase per decoded "
              f"token ({paired['step_us_added_per_token']:.0f} us of step); the constrained "
              f"steps take {paired['step_time_ratio']:.3f}x the plain ones' time in all "
              f"(forward {paired['forward_time_ratio']:.3f}x: the host check, 1 when quiet)")
        print(f"at full batch ({paired['full_batch_rows']:.0f} rows, "
              f"{paired['full_batch_pairs']:.0f} pairs): +"
              f"{paired['full_batch_sample_ms_added']:.2f} ms sample phase, +"
              f"{paired['full_batch_step_ms_added']:.2f} ms on a "
              f"{paired['full_batch_plain_step_ms']:.1f} ms plain step "
              f"({paired['full_batch_step_ratio']:.3f}x)")
    else:
        print("(the two arms' schedules differed: no paired steps)")

    firsts = list(compiled.first_s.values())
    print(f"\ngrammar compile: compiler set-up (vocabulary) {1e3 * compiled.setup_s:.0f} ms; "
          f"first compile per schema median {1e3 * statistics.median(firsts):.1f} ms, max "
          f"{1e3 * max(firsts):.1f} ms; cached median "
          f"{1e6 * statistics.median(compiled.cached_s.values()):.1f} us")
    print("  " + ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in compiled.first_s.items()))
    bounded = list(compiled.bounded_first_s.values())
    print(f"with the {compiled.bounded_timeout_s:g} s compile bound (timed in a helper "
          f"process first): helper start {1e3 * compiled.bounded_helper_start_s:.0f} ms; "
          f"first compile per schema median {1e3 * statistics.median(bounded):.1f} ms "
          f"({statistics.median(bounded) / statistics.median(firsts):.2f}x unbounded), max "
          f"{1e3 * max(bounded):.1f} ms; a 30-character schema past the bound refused after "
          f"{compiled.refused_after_s:.1f} s, the next new spec then "
          f"{1e3 * compiled.next_after_refusal_s:.0f} ms (helper restart included)")


def report_json(model: str, args: argparse.Namespace, main: BatchRun, validity: Validity,
                masking: MaskingResult, compiled: CompileTimes) -> dict[str, Any]:
    return {
        "benchmark": "structured_outputs",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                 "load_average_at_end": list(os.getloadavg())},
        "model": model,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "validity": validity.to_json(),
        "throughput": {"wall_s": main.wall_s, "requests": len(main.outputs),
                       "output_tokens": main.output_tokens,
                       "output_tokens_per_s": main.output_tokens / main.wall_s,
                       "requests_per_s": len(main.outputs) / main.wall_s,
                       "steps": len(main.steps), "preemptions": main.preemptions,
                       "decode_steps": asdict(StepSummary.of(decode_steps(main.steps)))},
        "masking": masking.to_json(),
        "compile": asdict(compiled),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--model", default=None,
                        help="model directory (default: SmolLM2-135M-Instruct, float32, "
                             "under $LORAGATE_HOME, fetched once)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--mask-requests", type=int, default=128)
    parser.add_argument("--mask-repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or str(ensure_default_model(loragate_home(), dtype="float32"))

    llm = LLM(model, device="cpu", max_num_seqs=args.max_num_seqs, seed=args.seed)
    engine = llm.engine
    cases = schema_cases()
    jobs = make_jobs(engine.tokenizer, cases, args.requests, max_tokens=args.max_tokens,
                     temperature=args.temperature, seed=args.seed)
    backend = validator_backend()
    compiled = measure_compile(engine, cases)
    warm_up(engine, jobs)
    print(f"validity: {len(jobs)} requests over {len(cases)} schemas ...", flush=True)

    rejections = RejectionCounter()
    logging.getLogger("engine.structured_output").addHandler(rejections)
    try:
        main_run = run_batch(engine, [j.prompt for j in jobs], [j.params for j in jobs],
                             "main")
        validity = check_outputs(jobs, main_run.outputs, backend)
        print(f"  {main_run.wall_s:.0f} s, {validity.total.invalid} invalid; masking cost: "
              f"{min(len(jobs), args.mask_requests)} requests x {args.mask_repeats} repeats "
              f"per arm ...", flush=True)
        masking = measure_masking(engine, jobs[:args.mask_requests], args.mask_repeats,
                                  backend)
    finally:
        logging.getLogger("engine.structured_output").removeHandler(rejections)

    print_report(model, args, main_run, validity, masking, compiled)
    print(f"tokens sampled outside their grammar (engine warnings): {rejections.count}")
    report = report_json(model, args, main_run, validity, masking, compiled)
    report["grammar_rejections"] = {"count": rejections.count, "first": rejections.first}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    for bad in validity.invalid[:5]:
        print(f"INVALID {bad['schema']} seed {bad['seed']}: {bad['errors'][0]}\n  "
              f"{bad['text']!r}")
    return report


if __name__ == "__main__":
    main()
