"""Request-rate sweep through the gateway: latency, normalized latency and goodput per rate.

    python -m benchmarks.rate_sweep --model DIR [--rates 0.5,1,2,4] [--requests 60] [--quick]

One engine and the gateway (real processes); for each rate the same seeded mixed workload
(prompts 32-512, outputs 16-128 tokens) arrives as a Poisson process. Reports per rate: the
achieved request throughput, TTFT and TPOT p50/p99, normalized latency (E2E / output tokens,
the metric of the vLLM and Orca papers) p50, and goodput under --slo-ttft-ms / --slo-tpot-ms.
Past the engine's capacity, goodput flattens (or falls) while latency climbs: the knee is
the rate to provision for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.gateway_process import start_gateway, stop_gateway
from benchmarks.serving import BenchConfig, from_workload, run_benchmark
from benchmarks.serving_metrics import SloSpec
from benchmarks.workloads import LengthRange, WorkloadSpec, generate
from engine.config import EngineConfig
from engine.models.loader import load_hf_config
from gateway.serve import start_engines, stop_engines, wait_ready

DEFAULT_OUT = Path(__file__).parent / "results" / "rate_sweep.json"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rates", default="0.5,1,2,4", help="requests/s, comma-separated")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=250.0)
    parser.add_argument("--quick", action="store_true", help="2 rates, 20 requests")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rates = [float(r) for r in ("0.5,2" if args.quick else args.rates).split(",")]
    num = 20 if args.quick else args.requests
    vocab = load_hf_config(args.model).vocab_size
    requests = from_workload(generate(WorkloadSpec(num, LengthRange(32, 512),
                                                   LengthRange(16, 128), vocab, seed=7)))
    slo = SloSpec(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    log_dir = Path(tempfile.mkdtemp(prefix="loragate-rate-sweep-"))
    engines = start_engines(EngineConfig(model=args.model, prefix_caching="off"), 1, log_dir,
                            {})
    gateway = None
    rows = []
    try:
        wait_ready(engines, 300)
        gateway = start_gateway(args.model, [engines[0].url], {}, log_dir)
        for rate in rates:
            result = asyncio.run(run_benchmark(BenchConfig(gateway.url, "openai", rate=rate,
                                                           seed=8, slo=slo), requests))
            m = result.metrics
            normalized = [r.e2e_s / r.output_tokens * 1000 for r in result.records
                          if r.success and r.output_tokens]
            rows.append({"rate": rate, "completed": m.completed, "failed": m.failed,
                         "request_throughput": m.request_throughput,
                         "output_throughput": m.output_throughput,
                         "ttft_p50_ms": m.ttft.median_ms, "ttft_p99_ms": m.ttft.p99_ms,
                         "tpot_p50_ms": m.tpot.median_ms, "tpot_p99_ms": m.tpot.p99_ms,
                         "normalized_latency_p50_ms_per_token": statistics.median(normalized),
                         "goodput": m.goodput})
            print(f"rate {rate:>5.2f}/s: {m.request_throughput:.2f} req/s, TTFT p50 "
                  f"{m.ttft.median_ms:.0f} ms, TPOT p50 {m.tpot.median_ms:.0f} ms, normalized "
                  f"{rows[-1]['normalized_latency_p50_ms_per_token']:.0f} ms/token, goodput "
                  f"{m.goodput:.2f} req/s", flush=True)
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        stop_engines(engines, 30)
    report = {"requests": num, "slo": {"ttft_ms": args.slo_ttft_ms,
                                       "tpot_ms": args.slo_tpot_ms}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
