"""loragate against vLLM's CPU build, side by side on this machine.

    python -m benchmarks.peers [--model DIR] [--venv PATH] [--quick] [--repeats N]
        [--parts agreement,mixed,rag,lora,serving] [--rates 0.25,0.5,1] [--profile-ops]
        [--dtype float32|bfloat16|auto] [--out FILE]

Creates the vLLM venv first if it is missing (benchmarks.peers.setup_venv), writes the
multi-LoRA adapters once under MODEL/peer-adapters, then runs the offline jobs and the
serving comparison, alternating loragate and vLLM, prints loragate / vLLM ratios and writes
everything as JSON (default benchmarks/results/peers/peers.json, peers-quick.json with
--quick; runner jobs, results and logs under benchmarks/results/peers/work/). The rows a
results table wants come from ``benchmarks.peers.report.headlines(report)``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.peers.adapters import ensure_peer_adapters
from benchmarks.peers.engines import PeerEnv
from benchmarks.peers.job import EngineSettings
from benchmarks.peers.offline import run_alternating
from benchmarks.peers.op_profile import kind_table
from benchmarks.peers.plan import FULL, PARTS, QUICK, offline_jobs
from benchmarks.peers.report import (
    Agreement,
    ServingRow,
    ThroughputFigures,
    compare_outputs,
    table,
    throughput_figures,
)
from benchmarks.peers.serving import run_serving
from benchmarks.peers.setup_venv import DEFAULT_VENV, ensure_venv
from benchmarks.peers.workloads import Corpus, mixed_requests, warmup_requests
from benchmarks.serving_client import ServingRequest

RESULTS = Path(__file__).resolve().parents[1] / "results" / "peers"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct in "
                                   "~/.cache/loragate/models)")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                   help="vLLM venv, created if missing (default: $LORAGATE_PEER_VENV, else "
                        ".peers/vllm-venv)")
    p.add_argument("--quick", action="store_true", help="smoke sizes, a few minutes' work")
    p.add_argument("--repeats", type=int, help="runs per engine (default 2, 1 with --quick)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of "
                                                           + ",".join(PARTS))
    p.add_argument("--rates", help="serving request rates, comma-separated req/s")
    p.add_argument("--threads", type=int, default=EngineSettings.threads)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"),
                   default=EngineSettings.dtype,
                   help="both engines' dtype (bfloat16: vLLM's CPU default; loragate's "
                        "\"auto\" on a CPU with AMX; auto: each engine's own default)")
    p.add_argument("--omp-wait-policy", choices=("active", "passive"), default="",
                   help="OMP_WAIT_POLICY for both engines (default: the runtime's; passive "
                        "on a host shared with other work, where spinning threads stall)")
    p.add_argument("--vllm-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run vLLM without torch.compile (default: only with --quick, where "
                        "its minutes of compiling per start would dominate)")
    p.add_argument("--profile-ops", action="store_true",
                   help="torch's profiler over each engine's timed phases: op times by kind "
                        "side by side (slower; for where the time goes, not for the ratios)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    if unknown := set(parts) - set(PARTS):
        p.error(f"unknown part(s) {sorted(unknown)}; parts: {', '.join(PARTS)}")
    args.parts = parts
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "load_average": os.getloadavg(), "note": "shared host: other work may run "
            "beside the benchmark; compare ratios from the same run"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from engine.default_model import default_model_dir

    started = time.monotonic()
    sizes = QUICK if args.quick else FULL
    if args.repeats is not None:
        sizes = replace(sizes, repeats=args.repeats)
    if args.rates:
        sizes = replace(sizes, serving_rates=tuple(float(r) for r in args.rates.split(",")))
    model = str(args.model or default_model_dir())
    peer = PeerEnv(ensure_venv(args.venv.resolve()))
    eager = args.quick if args.vllm_eager is None else args.vllm_eager
    settings = EngineSettings(threads=args.threads, dtype=args.dtype, vllm_eager=eager,
                              omp_wait_policy=args.omp_wait_policy,
                              profile_ops=args.profile_ops)
    tokenizer = AutoTokenizer.from_pretrained(model)

    def tokenize(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    corpus = Corpus.load(tokenize)
    adapters = ensure_peer_adapters(model, sizes.lora_adapters) if "lora" in args.parts else {}
    out = args.out or RESULTS / ("peers-quick.json" if args.quick else "peers.json")
    workdir = RESULTS / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "stamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
        "quick": args.quick, "model": model, "settings": asdict(settings),
        "sizes": asdict(sizes), "machine_start": machine(), "throughput": [],
        "agreement": {}, "serving": None, "startup_s": {}, "part_seconds": {}}

    figures: list[ThroughputFigures] = []
    agreement: dict[str, Agreement] = {}
    for planned in offline_jobs(args.parts, sizes, model, corpus, tokenize, adapters,
                                settings):
        t0 = time.monotonic()
        runs = run_alternating(peer, planned.job, sizes.repeats, workdir, planned.tag)
        report["part_seconds"][planned.tag] = time.monotonic() - t0
        report["startup_s"][planned.tag] = {e: [r["startup_s"] for r in rs]
                                            for e, rs in runs.results.items()}
        report.setdefault("versions", {}).update(
            {e: rs[0]["version"] for e, rs in runs.results.items()})
        report.setdefault("dtypes", {}).update(
            {e: rs[0]["dtype"] for e, rs in runs.results.items()})
        for part in planned.parts:
            ours, theirs = runs.results["loragate"], runs.results["vllm"]
            agreement[part] = compare_outputs(ours[0]["phases"][part]["output_token_ids"],
                                              theirs[0]["phases"][part]["output_token_ids"])
            if part != "agreement":
                figures.append(throughput_figures(part, ours, theirs))
            if args.profile_ops:
                print(kind_table(part, ours[0]["phases"][part], theirs[0]["phases"][part]),
                      flush=True)

    serving_rows: list[ServingRow] = []
    if "serving" in args.parts:
        t0 = time.monotonic()
        requests = [ServingRequest(r.prompt_token_ids, r.output_len) for r in mixed_requests(
            corpus, sizes.serving_requests, sizes.serving_prompt, sizes.serving_output, seed=3)]
        warm = [ServingRequest(r.prompt_token_ids, r.output_len)
                for r in warmup_requests(tokenize)]
        serving_rows, startup = run_serving(peer, model, settings, sizes.serving_rates,
                                            requests, warm, sizes.repeats, workdir)
        report["part_seconds"]["serving"] = time.monotonic() - t0
        report["startup_s"]["serving"] = startup
        report["serving"] = {"num_requests": len(requests),
                             "rows": [r.to_json() for r in serving_rows]}

    report["throughput"] = [f.to_json() for f in figures]
    report["agreement"] = {k: a.to_json() for k, a in agreement.items()}
    report["machine_end"] = machine()
    report["total_s"] = time.monotonic() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(figures, agreement, serving_rows))
    if eager:
        print("vLLM ran eager (--vllm-eager): its compiled speed is not in these figures")
    print(f"total {report['total_s']:.0f} s; wrote {out} (shared host: ratios, not absolute "
          f"times, are the figure)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
