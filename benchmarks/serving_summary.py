"""Serving benchmark results as the flat dicts of figures the gateway benchmark reports: one
run, or several runs pooled into one."""

from __future__ import annotations

from typing import Any

from benchmarks.serving import BenchResult
from benchmarks.serving_metrics import ServingMetrics, summarize


def run_summary(result: BenchResult) -> dict[str, Any]:
    """One run's figures, with its prefix-cache hit rate when it measured one."""
    out = metrics_summary(result.metrics)
    if result.prefix_cache is not None:
        out["prefix_hit_rate"] = result.prefix_cache.hit_rate
        out["prefix_hit_tokens"] = result.prefix_cache.hit_tokens
    return out


def metrics_summary(m: ServingMetrics) -> dict[str, Any]:
    """Throughput, latency percentiles and failures of one set of serving metrics."""
    return {
        "completed": m.completed, "failed": m.failed, "duration_s": m.duration_s,
        "request_throughput": m.request_throughput, "output_throughput": m.output_throughput,
        "ttft_p50_ms": m.ttft.median_ms, "ttft_p99_ms": m.ttft.p99_ms,
        "e2e_p50_ms": m.e2e.median_ms, "e2e_p99_ms": m.e2e.p99_ms,
        "itl_p50_ms": m.itl.median_ms, "failures": m.failures}


def pooled_summary(results: list[BenchResult]) -> dict[str, Any]:
    """Several runs' requests as if one run (their durations added)."""
    records = [r for result in results for r in result.records]
    duration = sum(result.metrics.duration_s for result in results)
    return metrics_summary(summarize(records, duration, results[0].config.slo))
