"""The whole benchmark suite, one command:

    python -m benchmarks --model DIR [--quick] [--only NAME,NAME] [--skip NAME,NAME]

Runs each benchmark as its own process (each starts and stops its own engines), in order:
throughput (engine vs transformers static batching), prefix (RAG prefix caching off/on/auto),
lora (adapter-count sweep vs PEFT per-adapter batching), interference (chunked prefill on/off
under a decode load), rate (request-rate sweep through the gateway), gateway (gateway overhead,
router vs round-robin) and tenancy (auth + rate-limit overhead, Redis vs memory). Each writes
its JSON under benchmarks/results/; the suite then draws a PNG per benchmark into
benchmarks/plots/ and rewrites the generated block of benchmarks/RESULTS.md (between the
SUITE markers) with every headline ratio beside its target; benchmarks left out with --only
or --skip keep the figures (and plots) of their last run of the same size, stamped with its
time. --quick runs every benchmark's smoke size: minutes here, and its numbers are not the
benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.suite_plots import draw_plots
from benchmarks.suite_report import headline_rows, render_block, replace_block

HERE = Path(__file__).parent
RESULTS = HERE / "results"


@dataclass(frozen=True)
class Part:
    name: str
    module: str
    out_flag: str
    quick_args: tuple[str, ...] = ("--quick",)


PARTS = (
    Part("throughput", "benchmarks.throughput", "--output"),
    Part("prefix", "benchmarks.prefix_cache", "--out"),
    Part("lora", "benchmarks.lora_throughput", "--output"),
    Part("interference", "benchmarks.interference", "--out"),
    Part("rate", "benchmarks.rate_sweep", "--out"),
    Part("gateway", "benchmarks.gateway_bench", "--out"),
    Part("tenancy", "benchmarks.tenancy_bench", "--out", ("--requests", "40")),
)


def run_part(part: Part, model: str, quick: bool, log_dir: Path) -> dict[str, Any]:
    out = RESULTS / f"{part.name}.json"
    command = [sys.executable, "-m", part.module, "--model", model, part.out_flag, str(out),
               *(part.quick_args if quick else ())]
    log = log_dir / f"{part.name}.log"
    start = time.monotonic()
    with open(log, "wb") as handle:
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{part.name} failed (exit {code}); log {log}:\n" + "\n".join(tail))
    report = json.loads(out.read_text())
    report["_seconds"] = time.monotonic() - start
    report["_stamp"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")
    report["_quick"] = quick
    out.write_text(json.dumps(report, indent=2))
    return dict(report)


def earlier_reports(skipped: list[Part], quick: bool) -> dict[str, dict[str, Any]]:
    """The last suite-run report of each benchmark not run this time, of the same size."""
    found: dict[str, dict[str, Any]] = {}
    for part in skipped:
        path = RESULTS / f"{part.name}.json"
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and "_stamp" in report and report.get("_quick") == quick:
            found[part.name] = report
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated part names")
    parser.add_argument("--skip", default="", help="comma-separated part names")
    parser.add_argument("--results-md", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args(argv)
    names = [p.name for p in PARTS]
    only = [n for n in args.only.split(",") if n] or names
    skip = {n for n in args.skip.split(",") if n}
    unknown = (set(only) | skip) - set(names)
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; parts: {', '.join(names)}")
    parts = [p for p in PARTS if p.name in only and p.name not in skip]
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_dir = RESULTS / "logs"
    log_dir.mkdir(exist_ok=True)
    reports: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    with tqdm(parts, unit="benchmark") as bar:
        for part in bar:
            bar.set_description(part.name)
            try:
                reports[part.name] = run_part(part, args.model, args.quick, log_dir)
            except (RuntimeError, OSError, ValueError) as exc:
                failures[part.name] = str(exc)
                tqdm.write(f"{part.name}: FAILED\n{exc}")
    kept = earlier_reports([p for p in PARTS if p not in parts], args.quick)
    reports = {p.name: {**kept, **reports}[p.name] for p in PARTS
               if p.name in reports or p.name in kept}
    plots = draw_plots(reports, HERE / "plots")
    rows = headline_rows(reports)
    stamps = {name: str(report["_stamp"]) for name, report in reports.items()}
    block = render_block(rows, plots, stamps, args.quick, failures, HERE)
    if args.results_md.exists():
        args.results_md.write_text(replace_block(args.results_md.read_text(), block))
    for row in rows:
        print(f"{row.benchmark:<13} {row.metric:<45} {row.value:>10}  target {row.target}")
    print(f"plots: {', '.join(str(p) for p in plots)}; RESULTS block updated in "
          f"{args.results_md}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
