"""Online serving benchmark: stream seeded requests at an HTTP endpoint, report vLLM-style
latency (TTFT, TPOT, ITL, E2E), throughput and goodput.

    python -m benchmarks.serving --base-url http://127.0.0.1:8000 --protocol openai \\
        --workload rag --num-requests 200 --rate 8 --burstiness 1 --num-adapters 4 \\
        --slo-ttft-ms 500 --slo-tpot-ms 50 --metrics-url http://127.0.0.1:8000/metrics \\
        --out results.json

Requests are sent at seeded gamma-process offsets (``--rate`` mean requests/s, ``inf`` = all
at once; ``--burstiness`` 1 = Poisson) no matter what arrival times a workload carries;
``--max-concurrency`` caps requests in flight. ``openai`` targets the gateway's
/v1/completions, ``engine`` an engine server's /generate (see benchmarks.serving_client).
From other scripts: build ``ServingRequest``s (``from_workload``, ``assign_adapters``) and
``await run_benchmark(BenchConfig(...), requests)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.rag_workload import RagRequest, RagSpec, make_rag_workload
from benchmarks.serving_client import (
    PROTOCOLS,
    Protocol,
    ServingRequest,
    discover_model,
    send_request,
)
from benchmarks.serving_metrics import (
    RequestRecord,
    ServingMetrics,
    SloSpec,
    arrival_offsets,
    counter_totals,
    summarize,
    with_goodput,
)
from benchmarks.workloads import BenchRequest, generate, mixed_workload

HIT_SAMPLE = "loragate_prefix_cache_hit_tokens_total"
QUERY_SAMPLE = "loragate_prefix_cache_query_tokens_total"


@dataclass(frozen=True)
class BenchConfig:
    """Where and how to send one benchmark run."""

    base_url: str
    protocol: Protocol = "openai"
    model_name: str | None = None
    """Base model name for the openai protocol; None = first entry of GET /v1/models."""
    rate: float = math.inf
    """Mean requests per second; inf sends every request at once."""
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier."""
    max_concurrency: int | None = None
    """At most this many requests in flight; None = no cap."""
    seed: int = 0
    slo: SloSpec = field(default_factory=SloSpec)
    metrics_urls: tuple[str, ...] = ()
    """Prometheus endpoints scraped before and after for the prefix-cache hit delta."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer``."""
    timeout_s: float = 600.0
    """Per-request connect/read timeout."""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        arrival_offsets(0, self.rate, self.burstiness)  # validates rate and burstiness


@dataclass(frozen=True)
class PrefixCacheDelta:
    """Prefix-cache token counters gained during the run, summed over all series and URLs."""

    hit_tokens: float
    query_tokens: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True)
class BenchResult:
    """One run: its config, the model it addressed, the metrics and every request's record."""

    config: BenchConfig
    model_name: str | None
    metrics: ServingMetrics
    prefix_cache: PrefixCacheDelta | None
    records: tuple[RequestRecord, ...]

    def to_json(self, detailed: bool = False) -> dict[str, Any]:
        """A JSON-safe dict; per-request records only when ``detailed``."""
        config = asdict(self.config)
        config["rate"] = "inf" if math.isinf(self.config.rate) else self.config.rate
        config["api_key"] = "<redacted>" if self.config.api_key else None
        out: dict[str, Any] = {"config": config, "model_name": self.model_name,
                               "metrics": asdict(self.metrics), "prefix_cache": None}
        if self.prefix_cache is not None:
            out["prefix_cache"] = {**asdict(self.prefix_cache),
                                   "hit_rate": self.prefix_cache.hit_rate}
        if detailed:
            out["records"] = [asdict(r) for r in self.records]
        return out


def from_workload(requests: Sequence[BenchRequest | RagRequest]) -> list[ServingRequest]:
    """ServingRequests (no adapter) from the mixed or RAG workload generators."""
    return [ServingRequest(tuple(r.prompt_token_ids), r.output_len) for r in requests]


def assign_adapters(requests: Sequence[ServingRequest], adapters: Sequence[str],
                    seed: int = 0, sessions: Sequence[int] | None = None
                    ) -> list[ServingRequest]:
    """Each request gets one adapter drawn uniformly with a seeded generator (same seed,
    same assignment); with ``sessions`` (one id per request) every request of a conversation
    gets its conversation's adapter. No adapters leaves the requests on the base model."""
    if not adapters:
        return list(requests)
    rng = random.Random(seed)
    if sessions is None:
        return [replace(r, lora=rng.choice(adapters)) for r in requests]
    by_session: dict[int, str] = {}
    assigned = []
    for request, session in zip(requests, sessions, strict=True):
        if session not in by_session:
            by_session[session] = rng.choice(adapters)
        assigned.append(replace(request, lora=by_session[session]))
    return assigned


async def _scrape(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, float] | None:
    totals = {HIT_SAMPLE: 0.0, QUERY_SAMPLE: 0.0}
    try:
        for url in urls:
            response = await client.get(url)
            response.raise_for_status()
            for name, value in counter_totals(response.text, (HIT_SAMPLE, QUERY_SAMPLE)).items():
                totals[name] += value
    except (httpx.HTTPError, ValueError) as exc:
        print(f"warning: metrics scrape failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return totals


async def run_benchmark(config: BenchConfig, requests: Sequence[ServingRequest]) -> BenchResult:
    """Send ``requests`` on the config's arrival schedule and measure them. Failed requests
    are counted in the result; only a failed model discovery raises."""
    if not requests:
        raise ValueError("run_benchmark needs at least one request")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.timeout_s)
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=64)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = config.model_name
        if config.protocol == "openai" and model is None:
            model = await discover_model(client, config.base_url)
        before = await _scrape(client, config.metrics_urls) if config.metrics_urls else None
        offsets = arrival_offsets(len(requests), config.rate, config.burstiness, config.seed)
        gate = asyncio.Semaphore(config.max_concurrency or len(requests))
        t0 = time.perf_counter()

        async def one(request: ServingRequest, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            async with gate:
                return await send_request(client, config.protocol, config.base_url, request,
                                          model, time.perf_counter() - t0)

        records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets,
                                                                      strict=True)))
        duration = time.perf_counter() - t0
        after = await _scrape(client, config.metrics_urls) if before is not None else None
    delta = None
    if before is not None and after is not None:
        delta = PrefixCacheDelta(after[HIT_SAMPLE] - before[HIT_SAMPLE],
                                 after[QUERY_SAMPLE] - before[QUERY_SAMPLE])
    metrics = summarize(list(records), duration, config.slo)
    return BenchResult(config, model, metrics, delta, tuple(records))


def format_table(result: BenchResult) -> str:
    """The vLLM-style result table."""
    m = result.metrics
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", m.completed), ("Failed requests:", m.failed),
        ("Benchmark duration (s):", f"{m.duration_s:.2f}"),
        ("Total input tokens:", m.total_input_tokens),
        ("Total generated tokens:", m.total_output_tokens),
        ("Request throughput (req/s):", f"{m.request_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}")]
    if m.goodput is not None:
        rows.append(("Request goodput (req/s):", f"{m.goodput:.2f}"))
    if result.prefix_cache is not None:
        rows.append(("Prefix cache hit rate:", f"{result.prefix_cache.hit_rate:.2%}"))
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    sections = (("Time to First Token", "TTFT", m.ttft), ("Time per Output Token (excl. 1st "
                "token)", "TPOT", m.tpot), ("Inter-token Latency", "ITL", m.itl),
                ("End-to-end Latency", "E2E", m.e2e))
    for title, short, stats in sections:
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        lines += [f"{f'Mean {short} (ms):':<40}{stats.mean_ms:<10.2f}",
                  f"{f'Median {short} (ms):':<40}{stats.median_ms:<10.2f}",
                  f"{f'P99 {short} (ms):':<40}{stats.p99_ms:<10.2f}"]
    for kind, count in sorted(m.failures.items()):
        lines.append(f"{'Failures ' + kind + ':':<40}{count:<10}")
    lines.append("=" * 50)
    return "\n".join(lines)


def build_requests(args: argparse.Namespace) -> list[ServingRequest]:
    """The CLI's workload, with adapters assigned when asked for."""
    if args.workload == "rag":
        spec = RagSpec(num_requests=args.num_requests, num_documents=args.num_documents,
                       docs_per_request=args.docs_per_request, output_len=args.rag_output_len,
                       system_prompt_len=args.system_prompt_len, vocab_size=args.vocab_size,
                       seed=args.seed)
        requests = from_workload(make_rag_workload(spec))
    else:
        requests = from_workload(generate(mixed_workload(args.num_requests, args.vocab_size,
                                                         args.seed)))
    if args.adapters:
        adapters = [a for a in args.adapters.split(",") if a]
    else:
        adapters = [f"demo-{i}" for i in range(args.num_adapters)]
    return assign_adapters(requests, adapters, args.seed)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--protocol", choices=PROTOCOLS, default="openai")
    p.add_argument("--model-name", help="base model name (openai); default: GET /v1/models")
    p.add_argument("--api-key", default=os.environ.get("LORAGATE_API_KEY"))
    p.add_argument("--workload", choices=("mixed", "rag"), default="mixed")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--vocab-size", type=int, default=8192, help="token ids drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-documents", type=int, default=64, help="rag: corpus size")
    p.add_argument("--docs-per-request", type=int, default=3, help="rag: retrieved documents")
    p.add_argument("--system-prompt-len", type=int, default=256, help="rag: shared prefix")
    p.add_argument("--rag-output-len", type=int, default=32, help="rag: tokens per answer")
    p.add_argument("--adapters", help="comma-separated adapter names, one drawn per request")
    p.add_argument("--num-adapters", type=int, default=0, help="adapters demo-0..demo-N-1")
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf = all)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--slo-e2e-ms", type=float)
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS")
    p.add_argument("--metrics-url", action="append", default=[], help="repeatable")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    p.add_argument("--save-detailed", action="store_true", help="per-request records in JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        slo = with_goodput(SloSpec(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms),
                           args.goodput)
        config = BenchConfig(args.base_url, args.protocol, args.model_name, args.rate,
                             args.burstiness, args.max_concurrency, args.seed, slo,
                             tuple(args.metrics_url), args.api_key, args.timeout_s)
        requests = build_requests(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    result = asyncio.run(run_benchmark(config, requests))
    print(format_table(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result.to_json(args.save_detailed), indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
