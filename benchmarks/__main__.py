"""The whole benchmark suite, one command:

    python -m benchmarks --model DIR [--label NAME] [--size full|medium|quick] [--threads N]
        [--only NAME,NAME] [--skip NAME,NAME]

Runs each benchmark as its own process (each starts and stops its own engines), in order:
throughput (engine vs transformers static batching), prefix (RAG prefix caching off/on/auto),
lora (adapter-count sweep vs PEFT per-adapter batching), interference (chunked prefill on/off
under a decode load), rate (request-rate sweep through the gateway), gateway (gateway overhead,
router vs round-robin), tenancy (auth + rate-limit overhead, Redis vs memory) and peers
(loragate against vLLM's CPU build on the same workloads; it needs the vLLM venv that
``benchmarks.peers`` creates on its first run, see benchmarks/peers/setup_venv.py).

Results are kept per model: ``--label`` (default: "demo" or "wide" for the shapes of
``loragate make-demo``, else the model directory's name) names the model's column in
RESULTS.md, its JSON reports under benchmarks/results/LABEL/SIZE/ and its plots under
benchmarks/plots/LABEL/. After the run the suite records each benchmark's headline rows, with
the time, the commit measured, the size and its arguments, in benchmarks/suite_figures.json
(the latest run of every benchmark on every model), draws the PNGs of the benchmarks it ran,
and rewrites the generated block of benchmarks/RESULTS.md (between the SUITE markers) from
that record: every model's figures side by side. Benchmarks and models not run keep their
recorded figures.

Sizes: ``full`` is each benchmark's defaults (hours on 2 CPU cores with the ~32M demo model);
``medium`` runs only the headline benchmarks (throughput, prefix, lora, gateway overhead) at
sizes that take about 40 minutes with SmolLM2-135M on 2 shared cores with ``--threads 1``,
then peers' offline workloads once each (no serving; vLLM compiles its graph at each of its
three starts, minutes apiece);
``quick`` (or ``--quick``) is every benchmark's smoke size: minutes, its numbers are not the
benchmark, and it records nothing. ``--threads N`` sets each process's torch threads
(OMP_NUM_THREADS, or the benchmark's own flag where it sets its engines' threads itself, as
peers does); on cores shared with other work, 1 is far steadier than the default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks import suite_record
from benchmarks.suite_plots import draw_plots
from benchmarks.suite_record import PartRecord
from benchmarks.suite_report import PART_ORDER, headline_rows, render_block, replace_block

HERE = Path(__file__).parent
RESULTS = HERE / "results"
PLOTS = HERE / "plots"
FIGURES = HERE / "suite_figures.json"
SIZES = ("full", "medium", "quick")


@dataclass(frozen=True)
class Part:
    name: str
    module: str
    out_flag: str
    sizes: Mapping[str, tuple[str, ...]]
    """size -> the benchmark's arguments; a part without a size is not run at that size."""
    threads_flag: str = ""
    """The benchmark's flag for the suite's --threads, where it sets its engines' threads
    itself and would override OMP_NUM_THREADS ("" = the environment carries it)."""


PARTS = (
    Part("throughput", "benchmarks.throughput", "--output", {
        "full": (), "quick": ("--quick",),
        "medium": ("--num-requests", "48", "--max-batch", "16")}),
    Part("prefix", "benchmarks.prefix_cache", "--out", {
        "full": (), "quick": ("--quick",),
        "medium": ("--num-requests", "32", "--num-documents", "32", "--warm-requests", "32",
                   "--kv-blocks", "4096", "--modes", "on,off", "--no-shuffled", "--no-wide")}),
    Part("lora", "benchmarks.lora_throughput", "--output", {
        "full": (), "quick": ("--quick",),
        "medium": ("--num-requests", "64", "--adapter-counts", "16",
                   "--distributions", "uniform")}),
    Part("interference", "benchmarks.interference", "--out", {
        "full": (), "quick": ("--quick",)}),
    Part("rate", "benchmarks.rate_sweep", "--out", {"full": (), "quick": ("--quick",)}),
    Part("gateway", "benchmarks.gateway_bench", "--out", {
        "full": (), "quick": ("--quick",),
        "medium": ("--part", "overhead", "--overhead-requests", "60", "--overhead-rate",
                   "1")}),
    Part("tenancy", "benchmarks.tenancy_bench", "--out", {
        "full": (), "quick": ("--requests", "40")}),
    # medium leaves serving out: both OpenAI servers at every request rate take long, and its
    # figures are not among the headline ones medium is for. peers sets its engines' threads
    # from its own --threads (default 2) over OMP_NUM_THREADS, so the suite passes it there.
    Part("peers", "benchmarks.peers", "--out", {
        "full": (), "quick": ("--quick",),
        "medium": ("--repeats", "1", "--parts", "agreement,mixed,rag,lora")},
        threads_flag="--threads"),
)
assert tuple(p.name for p in PARTS) == PART_ORDER


def stamp_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")


def part_command(part: Part, args: argparse.Namespace, out: Path) -> list[str]:
    """The benchmark's command line: its model, report path, size arguments and, where it
    takes the thread count as a flag, the suite's --threads."""
    threads = (part.threads_flag, str(args.threads)) if part.threads_flag and args.threads else ()
    return [sys.executable, "-m", part.module, "--model", args.model, part.out_flag, str(out),
            *part.sizes[args.size], *threads]


def run_part(part: Part, args: argparse.Namespace, out_dir: Path, log_dir: Path
             ) -> dict[str, Any]:
    """Run one benchmark process; its JSON report with _seconds and _stamp added."""
    out = out_dir / f"{part.name}.json"
    command = part_command(part, args, out)
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    log = log_dir / f"{part.name}.log"
    stamp, start = stamp_now(), time.monotonic()
    with open(log, "wb") as handle:
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{part.name} failed (exit {code}); log {log}:\n" + "\n".join(tail))
    report = json.loads(out.read_text())
    report["_seconds"] = time.monotonic() - start
    report["_stamp"] = stamp
    report["_size"] = args.size
    out.write_text(json.dumps(report, indent=2))
    return dict(report)


def chosen_parts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Part]:
    names = [p.name for p in PARTS]
    only = [n for n in args.only.split(",") if n]
    skip = {n for n in args.skip.split(",") if n}
    unknown = (set(only) | skip) - set(names)
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; parts: {', '.join(names)}")
    sized = [p.name for p in PARTS if args.size in p.sizes]
    missing = sorted(set(only) - set(sized))
    if missing:
        parser.error(f"no {args.size} size for {missing}; {args.size}: {', '.join(sized)}")
    return [p for p in PARTS
            if p.name in (only or sized) and p.name not in skip and args.size in p.sizes]


def plots_by_label(models: Mapping[str, object]) -> dict[str, list[Path]]:
    """Every model's PNGs on disk, in benchmark order."""
    return {label: [PLOTS / label / f"{name}.png" for name in PART_ORDER
                    if (PLOTS / label / f"{name}.png").exists()] for label in models}


def record_run(args: argparse.Namespace, parts: list[Part], reports: dict[str, dict[str, Any]],
               commit: str) -> None:
    """Record this run's figures, draw its plots and rewrite the RESULTS.md block."""
    records = {
        name: PartRecord(size=args.size, args=next(p for p in parts if p.name == name)
                         .sizes[args.size], threads=args.threads or None,
                         stamp=report["_stamp"], commit=commit,
                         seconds=round(report["_seconds"], 1),
                         rows=tuple(headline_rows({name: report})))
        for name, report in reports.items()}
    models = suite_record.merge(suite_record.load(args.figures), args.label,
                                suite_record.describe_model(args.model), records)
    suite_record.save(args.figures, models)
    draw_plots(reports, PLOTS / args.label)
    block = render_block(models, plots_by_label(models), args.results_md.parent)
    if args.results_md.exists():
        args.results_md.write_text(replace_block(args.results_md.read_text(), block))
    print(f"recorded in {args.figures}; plots in {PLOTS / args.label}; RESULTS block "
          f"updated in {args.results_md}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--label", default=None,
                        help="the model's name in RESULTS.md and under results/ and plots/")
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--quick", action="store_true", help="same as --size quick")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per benchmark process (default: torch's choice)")
    parser.add_argument("--only", default="", help="comma-separated part names")
    parser.add_argument("--skip", default="", help="comma-separated part names")
    parser.add_argument("--results-md", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--figures", type=Path, default=FIGURES,
                        help="the suite's record of figures (JSON)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size = "quick"
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    args.label = args.label or suite_record.default_label(args.model)
    parts = chosen_parts(parser, args)
    out_dir = RESULTS / args.label / args.size
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    commit = suite_record.measured_commit()
    print(f"model {args.model} as '{args.label}', size {args.size}, commit {commit}, "
          f"parts {', '.join(p.name for p in parts)}", flush=True)
    reports: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    with tqdm(parts, unit="benchmark") as bar:
        for part in bar:
            bar.set_description(part.name)
            try:
                reports[part.name] = run_part(part, args, out_dir, log_dir)
            except (RuntimeError, OSError, ValueError) as exc:
                failures[part.name] = str(exc)
                tqdm.write(f"{part.name}: FAILED\n{exc}")
    for row in headline_rows(reports):
        print(f"{row.benchmark:<13} {row.metric:<50} {row.value:>10}  target {row.target}")
    if args.size != "quick" and reports:
        record_run(args, parts, reports, commit)
    for name, report in reports.items():
        print(f"{name}: {report['_seconds']:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
