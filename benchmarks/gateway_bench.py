"""Serving benchmarks (gateway overhead, routing), each measured side by side in one run.

    python -m benchmarks.gateway_bench --model DIR [--quick]
        [--part overhead|routing|index|all]
        [--gateway-mode process|inprocess]

1. Gateway overhead: one engine process; a workload of short prompts and 16 output tokens
   split in two halves, one sent straight to the engine's /generate and the other through
   the gateway's /v1/completions at the same time (each at half the rate, so both see the
   same engine load and the same machine), then again with the halves swapped; reports the
   added TTFT / E2E p50 and p99 over both rounds (target: added TTFT p50 <= 5 ms). Under
   load a request's TTFT includes waiting for the engine's current step, which makes that
   figure noisy by a few ms; so first, half the requests are also sent one at a time (direct
   and through the gateway alternately), which measures the gateway's own added TTFT without
   the step cadence. Prefix caching is off so repeats cost the same.
   ``--gateway-mode inprocess`` measures the default `loragate serve` instead: the gateway
   drives an engine in its own process (no HTTP hop to it), while the direct half goes to a
   separate engine process of the same configuration. The one-at-a-time figure is the
   comparable one there; side by side, the two engines share the machine's cores but not
   their queues.
2. Routing: the RAG workload (Zipf documents) spread over 8 adapters, served by 2 engine
   instances behind the gateway with round-robin routing and with our scoring router (fresh
   engines for each, so caches start cold), plus 1 instance for reference; reports
   throughput and the prefix hit rate summed over the instances' /metrics (target: router's
   hit rate >= 1.5x round-robin's). Two KV sizes per instance: one that holds about half
   the workload's distinct prefix blocks, and one under pressure (about a ninth), where
   what an instance keeps cached depends on which adapters' traffic it is sent. Beside the
   live runs, benchmarks/routing_replay.py replays the same request list against idealized
   caches: what one shared cache, round-robin and adapter-partitioned placement would get.
   Then the same runs (2 instances each way, 1 instance) at the pressured size on
   conversations (``--turns``, default 3): RAG chat, where each follow-up is the previous
   turn's prompt + answer + a question on the same documents, so a conversation's history
   is cached only where it was served.
3. Index sources: the scoring router on 2 instances, its prefix index fed by polling the
   engines' /state (``--poll-interval-s``, the gateway's default 0.5 s) and by the engines'
   KV events (``--kv-events``), on the conversations at the pressured size, in alternating
   order (``--repeats`` pairs). Reports the hit rates (target: events >= polling) and, from
   the gateway's own counters, the stale routes: requests whose instance read less of the
   prompt from its cache than the router credited it with.

Engines and the gateway are real processes on loopback ports (`loragate engine`,
`loragate serve --engine URL`). On a small CPU box every instance shares the same cores, so
2 instances add no compute there; the hit rate is what routing changes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_adapters import bench_adapters_dir, ensure_adapters
from benchmarks.gateway_process import start_gateway, stop_gateway
from benchmarks.routing_replay import replay_all, routing_workload
from benchmarks.serving import (
    BenchConfig,
    BenchResult,
    from_workload,
    run_benchmark,
)
from benchmarks.serving_client import Protocol, ServingRequest, discover_model, send_request
from benchmarks.serving_metrics import counter_totals
from benchmarks.serving_summary import pooled_summary, run_summary
from benchmarks.workloads import LengthRange, WorkloadSpec, generate
from engine.config import EngineConfig
from engine.models.loader import load_hf_config
from gateway.serve import free_port, start_engines, stop_engines, wait_ready

DEFAULT_OUT = Path(__file__).parent / "results" / "gateway_bench.json"


async def _side_by_side(direct: BenchConfig, routed: BenchConfig,
                        to_direct: list[ServingRequest], to_gateway: list[ServingRequest]
                        ) -> tuple[BenchResult, BenchResult]:
    """Both paths at once, each at half the rate: they share the engine, the cores and
    whatever else the machine is doing at that moment."""
    direct_result, gateway_result = await asyncio.gather(
        run_benchmark(direct, to_direct), run_benchmark(routed, to_gateway))
    return direct_result, gateway_result


async def _one_at_a_time(engine_url: str, gateway_url: str, requests: list[ServingRequest]
                         ) -> dict[str, list[float]]:
    """Each request sent alone, direct then through the gateway (order alternating), so
    neither waits for a step of the other's: TTFT without the engine's step cadence in it."""
    ttfts: dict[str, list[float]] = {"direct": [], "gateway": []}
    async with httpx.AsyncClient(timeout=60.0) as client:
        model = await discover_model(client, gateway_url)
        for i, request in enumerate(requests):
            order: list[tuple[str, str, Protocol]] = [("direct", engine_url, "engine"),
                                                      ("gateway", gateway_url, "openai")]
            for name, url, protocol in order[::-1] if i % 2 else order:
                record = await send_request(client, protocol, url, request, model, 0.0)
                if record.success:
                    ttfts[name].append(record.ttft_s * 1e3)
    return ttfts


def overhead(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    num = 40 if args.quick else args.overhead_requests
    vocab = load_hf_config(args.model).vocab_size
    requests = from_workload(generate(WorkloadSpec(num, LengthRange(32, 96), LengthRange(16, 16),
                                                   vocab, seed=1)))
    halves = (requests[0::2], requests[1::2])
    config = EngineConfig(model=args.model, prefix_caching="off")
    engines = start_engines(config, 1, log_dir, {})
    gateway = None
    results: dict[str, list[BenchResult]] = {"direct": [], "gateway": []}
    try:
        wait_ready(engines, 300)
        if args.gateway_mode == "inprocess":  # its own engine, in the gateway's process
            gateway = start_gateway(args.model, [], {}, log_dir, "--prefix-caching", "off")
        else:
            gateway = start_gateway(args.model, [engines[0].url], {}, log_dir)
        half_rate = args.overhead_rate / 2
        direct = BenchConfig(engines[0].url, "engine", rate=half_rate, seed=2)
        routed = BenchConfig(gateway.url, "openai", rate=half_rate, seed=3)
        print("overhead: one request at a time, alternating", flush=True)
        alone = asyncio.run(_one_at_a_time(engines[0].url, gateway.url, requests[:num // 2]))
        # Two rounds, the halves of the workload swapped between the paths.
        for round_, (mine, theirs) in enumerate((halves, halves[::-1]), 1):
            print(f"overhead round {round_}: direct and gateway side by side", flush=True)
            pair = asyncio.run(_side_by_side(direct, routed, mine, theirs))
            results["direct"].append(pair[0])
            results["gateway"].append(pair[1])
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        stop_engines(engines, 30)

    pooled = {name: pooled_summary(runs) for name, runs in results.items()}
    added = {key: pooled["gateway"][key] - pooled["direct"][key]
             for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
                         "itl_p50_ms")}
    alone_p50 = {name: statistics.median(values) for name, values in alone.items()}
    added_alone = alone_p50["gateway"] - alone_p50["direct"]
    print(f"gateway added TTFT p50 {added['ttft_p50_ms']:.2f} ms under load (target <= 5), "
          f"p99 {added['ttft_p99_ms']:.2f} ms; E2E p50 {added['e2e_p50_ms']:.2f} ms; one "
          f"request at a time {added_alone:.2f} ms", flush=True)
    return {"mode": args.gateway_mode, "requests": num, "rate": args.overhead_rate,
            "pooled": pooled,
            "runs": {name: [run_summary(r) for r in runs] for name, runs in results.items()},
            "added_ms": added,
            "one_at_a_time": {"requests": len(alone["direct"]), "ttft_p50_ms": alone_p50,
                              "added_ttft_p50_ms": added_alone}}


ROUTE_COUNTERS = ("stale_routes", "routed_prefix_credited_tokens",
                  "routed_prefix_found_tokens", "routed_cached_tokens")
"""The gateway's counters of how its prefix index matched the engines' caches."""


def _route_counters(gateway_url: str) -> dict[str, float]:
    totals = counter_totals(httpx.get(gateway_url + "/metrics", timeout=10.0).text,
                            tuple(f"loragate_gateway_{n}_total" for n in ROUTE_COUNTERS))
    return {name: totals[f"loragate_gateway_{name}_total"] for name in ROUTE_COUNTERS}


def _events_config(config: EngineConfig) -> EngineConfig:
    """Engines that publish KV events (each instance offsets the ports: for_instance)."""
    return dataclasses.replace(
        config, kv_events_endpoint=f"tcp://*:{free_port()}",
        kv_events_replay_endpoint=f"tcp://*:{free_port()}")


def routing_run(args: argparse.Namespace, log_dir: Path, instances: int, policy: str,
                kv_blocks: int, requests: list[ServingRequest],
                adapters: dict[str, str], *gateway_flags: str,
                kv_events: bool = False) -> dict[str, Any]:
    """Fresh engines and a gateway (``gateway_flags`` added to its command line), the
    requests through it; with ``kv_events`` the engines publish and the gateway follows."""
    # Instances split the cores instead of fighting for them (never more threads than the
    # caller's OMP_NUM_THREADS, e.g. the suite's --threads).
    before = os.environ.get("OMP_NUM_THREADS")
    share = max(1, (os.cpu_count() or 2) // instances)
    os.environ["OMP_NUM_THREADS"] = str(min(share, int(before)) if before else share)
    config = EngineConfig(model=args.model, max_loras=args.max_loras,
                          max_num_batched_tokens=512, max_num_seqs=32,
                          num_kv_blocks=kv_blocks)
    if kv_events:
        config = _events_config(config)
        gateway_flags = (*gateway_flags, "--kv-events", "true")
    engines = start_engines(config, instances, log_dir, adapters)
    gateway = None
    try:
        wait_ready(engines, 300)
        gateway = start_gateway(args.model, [e.url for e in engines], adapters, log_dir,
                                "--routing", policy, *gateway_flags)
        bench = BenchConfig(gateway.url, "openai", rate=args.rag_rate, seed=3,
                            metrics_urls=tuple(e.url + "/metrics" for e in engines))
        print(f"routing: {instances} instance(s), {policy}, {kv_blocks} KV blocks each"
              f"{', KV events' if kv_events else ''} {' '.join(gateway_flags)}", flush=True)
        result = run_summary(asyncio.run(run_benchmark(bench, requests)))
        result["index"] = _route_counters(gateway.url)
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        stop_engines(engines, 30)
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before
    print(f"  {result['request_throughput']:.2f} req/s, hit rate "
          f"{result.get('prefix_hit_rate', 0.0):.1%}, TTFT p50 {result['ttft_p50_ms']:.0f} ms",
          flush=True)
    return {"instances": instances, "policy": policy, "kv_blocks": kv_blocks,
            "kv_events": kv_events, **result}


def _routing_pair(args: argparse.Namespace, log_dir: Path, kv_blocks: int,
                  requests: list[ServingRequest], adapters: dict[str, str], label: str
                  ) -> tuple[list[dict[str, Any]], float]:
    """Round-robin then the scoring router on 2 fresh instances: both runs and the ratio of
    their hit rates."""
    pair = [routing_run(args, log_dir, 2, policy, kv_blocks, requests, adapters)
            for policy in ("round_robin", "score")]
    rr, ours = pair
    ratio = ours.get("prefix_hit_rate", 0.0) / max(1e-9, rr.get("prefix_hit_rate", 0.0))
    print(f"{label}, {kv_blocks} KV blocks: hit rate router / round-robin {ratio:.2f}x "
          f"(target >= 1.5x); throughput "
          f"{ours['request_throughput'] / max(1e-9, rr['request_throughput']):.2f}x", flush=True)
    return pair, ratio


def _replays(requests: list[ServingRequest], names: list[str], kv_blocks: list[int | None],
             label: str) -> list[dict[str, Any]]:
    replays = replay_all(requests, names, 2, kv_blocks)
    for r in replays:
        print(f"replay ({label}), {r.kv_blocks or 'unbounded'} KV blocks, {r.placement}: "
              f"hit rate {r.hit_rate:.1%}", flush=True)
    return [asdict(r) for r in replays]


def routing(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    paths = ensure_adapters(args.model, bench_adapters_dir(args.model), 8)
    names = list(paths)
    adapters = {n: str(p) for n, p in paths.items()}
    vocab_size = load_hf_config(args.model).vocab_size
    num_requests = 40 if args.quick else args.rag_requests
    requests = routing_workload(num_requests, names, vocab_size)
    replays = _replays(requests, names, [None, *args.kv_blocks], "single-turn")
    runs: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    for kv_blocks in args.kv_blocks:
        pair, ratios[str(kv_blocks)] = _routing_pair(args, log_dir, kv_blocks, requests,
                                                     adapters, "single-turn")
        runs += pair
    runs.append(routing_run(args, log_dir, 1, "score", args.kv_blocks[0], requests, adapters))
    report: dict[str, Any] = {
        "requests": len(requests), "adapters": names, "rate": args.rag_rate,
        "runs": runs, "replay": replays, "hit_rate_ratio_by_kv_blocks": ratios,
        "hit_rate_ratio": ratios[str(args.kv_blocks[-1])]}
    if args.turns > 1:
        kv_blocks = args.kv_blocks[-1]
        conversations = routing_workload(num_requests, names, vocab_size, args.turns)
        conversation_replays = _replays(conversations, names, [None, kv_blocks],
                                        f"{args.turns}-turn conversations")
        pair, ratio = _routing_pair(args, log_dir, kv_blocks, conversations, adapters,
                                    f"{args.turns}-turn conversations")
        single = routing_run(args, log_dir, 1, "score", kv_blocks, conversations, adapters)
        report["conversations"] = {"turns": args.turns, "kv_blocks": kv_blocks,
                                   "runs": [*pair, single], "replay": conversation_replays,
                                   "hit_rate_ratio": ratio}
    return report


def index_sources(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """The scoring router on 2 instances, its prefix index fed by polling (the default
    interval) and by KV events, on the conversation workload at the pressured KV size:
    hit rates, and the routes that credited an instance with blocks it no longer had."""
    paths = ensure_adapters(args.model, bench_adapters_dir(args.model), 8)
    adapters = {n: str(p) for n, p in paths.items()}
    num_requests = 40 if args.quick else args.rag_requests
    conversations = routing_workload(num_requests, list(paths),
                                     load_hf_config(args.model).vocab_size, max(2, args.turns))
    kv_blocks = args.kv_blocks[-1]
    poll = ("--poll-interval-s", str(args.poll_interval_s))
    runs = []
    for repeat in range(1 if args.quick else args.repeats):
        for events in (False, True) if repeat % 2 == 0 else (True, False):
            run = routing_run(args, log_dir, 2, "score", kv_blocks, conversations, adapters,
                              *poll, kv_events=events)
            index = run["index"]
            print(f"  {'KV events' if events else 'polling'}: stale routes "
                  f"{index['stale_routes']:.0f} of {run['completed']}, credited tokens found "
                  f"{index['routed_prefix_found_tokens']:.0f} / "
                  f"{index['routed_prefix_credited_tokens']:.0f}", flush=True)
            runs.append(run)

    def pooled(events: bool) -> dict[str, float]:
        mine = [r for r in runs if r["kv_events"] == events]
        return {"prefix_hit_rate": statistics.fmean(r["prefix_hit_rate"] for r in mine),
                **{k: sum(r["index"][k] for r in mine) for k in ROUTE_COUNTERS},
                "requests": sum(r["completed"] for r in mine)}

    polled, followed = pooled(False), pooled(True)
    ratio = followed["prefix_hit_rate"] / max(1e-9, polled["prefix_hit_rate"])
    print(f"KV events / polling ({args.poll_interval_s} s): hit rate {ratio:.3f}x (target >= "
          f"1.0x); stale routes {followed['stale_routes']:.0f} vs {polled['stale_routes']:.0f}",
          flush=True)
    return {"turns": max(2, args.turns), "kv_blocks": kv_blocks,
            "poll_interval_s": args.poll_interval_s, "runs": runs, "polling": polled,
            "kv_events": followed, "hit_rate_ratio": ratio}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--part", choices=("overhead", "routing", "index", "all"),
                        default="all")
    parser.add_argument("--quick", action="store_true", help="small runs (smoke test)")
    parser.add_argument("--overhead-rate", type=float, default=4.0,
                        help="overhead part: requests/s of both paths together")
    parser.add_argument("--overhead-requests", type=int, default=200,
                        help="overhead part: requests side by side (half of them are also "
                             "sent one at a time first)")
    parser.add_argument("--gateway-mode", choices=("process", "inprocess"), default="process",
                        help="overhead part: the gateway attached to the engine process "
                             "(process), or serving its own engine in its process (inprocess)")
    parser.add_argument("--rag-requests", type=int, default=120)
    parser.add_argument("--rag-rate", type=float, default=1.0)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3,
                        help="turns per conversation in the routing part's conversation "
                             "workload, run at the last --kv-blocks size (1: skip it)")
    parser.add_argument("--kv-blocks", type=lambda v: [int(x) for x in v.split(",")],
                        default=[2048, 512],
                        help="KV blocks per instance in the routing part, comma-separated; "
                             "the last is the headline (default 2048,512: about half and "
                             "about a ninth of the workload's 4730 distinct prefix blocks)")
    parser.add_argument("--poll-interval-s", type=float, default=0.5,
                        help="index part: the polling arm's interval (the gateway default)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="index part: polling/events pairs, order alternating")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="loragate-bench-"))
    print(f"process logs in {log_dir}", flush=True)
    report: dict[str, Any] = {}
    if args.part in ("overhead", "all"):
        report["overhead"] = overhead(args, log_dir)
    if args.part in ("routing", "all"):
        report["routing"] = routing(args, log_dir)
    if args.part in ("index", "all"):
        report["index"] = index_sources(args, log_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
