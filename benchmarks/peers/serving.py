"""The serving side: `loragate serve` against `vllm serve`, streamed /v1/completions at a few
request rates, TTFT and ITL percentiles per rate.

Each repeat starts one server (its own process group), waits for /health, sends a short
warm-up, then runs every rate with the same seeded requests and Poisson arrivals
(benchmarks.serving.run_benchmark, the client the other serving benchmarks use), and stops
the server before the other engine's starts: loragate, vLLM, loragate, vLLM, ...
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from benchmarks.peers.engines import ENGINES, EngineName, PeerEnv, engine_env, serve_command
from benchmarks.peers.job import EngineSettings
from benchmarks.peers.report import ServingRow, pooled_latency
from benchmarks.serving import BenchConfig, run_benchmark
from benchmarks.serving_client import ServingRequest
from gateway.serve import free_port

LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms",
                "request_throughput", "output_throughput", "completed", "failed")


def start_server(engine: EngineName, peer: PeerEnv, model: str, settings: EngineSettings,
                 log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(serve_command(engine, peer, model, settings, port),
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env=engine_env(engine, settings), start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen[bytes], url: str, log_path: Path,
                 timeout_s: float) -> float:
    """Seconds until GET /health answers 200; RuntimeError if the server exits or times out."""
    start = time.monotonic()
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() - start < timeout_s:
            if process.poll() is not None:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
                raise RuntimeError(f"server exited with {process.returncode}; {log_path}:\n{tail}")
            try:
                if client.get(url + "/health").status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"server {url} not healthy after {timeout_s:g} s; see {log_path}")


def stop_server(process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """SIGTERM to the server's process group (vLLM's front end, engine core and worker, or
    loragate's gateway and engine), SIGKILL to the group if it outlives ``timeout_s``."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with contextlib.suppress(ProcessLookupError):  # children that outlived their parent
        os.killpg(process.pid, signal.SIGKILL)


def latency_summary(url: str, rate: float, requests: Sequence[ServingRequest],
                    seed: int) -> dict[str, float]:
    result = asyncio.run(run_benchmark(BenchConfig(url, "openai", rate=rate, seed=seed),
                                       requests))
    m = result.metrics
    if m.failed:
        print(f"  warning: {m.failed} failed requests: {m.failures}", flush=True)
    return {"ttft_p50_ms": m.ttft.median_ms, "ttft_p99_ms": m.ttft.p99_ms,
            "itl_p50_ms": m.itl.median_ms, "itl_p99_ms": m.itl.p99_ms,
            "e2e_p50_ms": m.e2e.median_ms, "request_throughput": m.request_throughput,
            "output_throughput": m.output_throughput, "completed": float(m.completed),
            "failed": float(m.failed)}


def run_serving(peer: PeerEnv, model: str, settings: EngineSettings, rates: Sequence[float],
                requests: Sequence[ServingRequest], warmup: Sequence[ServingRequest],
                repeats: int, workdir: Path, startup_timeout_s: float = 900.0
                ) -> tuple[list[ServingRow], dict[EngineName, list[float]]]:
    """The rows per rate (each engine's metrics the median over repeats) and each server's
    seconds to become healthy, per repeat."""
    per_rate: dict[EngineName, dict[float, list[dict[str, float]]]] = {
        e: {rate: [] for rate in rates} for e in ENGINES}
    startup: dict[EngineName, list[float]] = {e: [] for e in ENGINES}
    for repeat in range(repeats):
        for engine in ENGINES:
            log = workdir / f"serve-{repeat}-{engine}.log"
            print(f"[serving] {engine} run {repeat + 1}/{repeats}: starting server ...",
                  flush=True)
            process, url = start_server(engine, peer, model, settings, log)
            try:
                startup[engine].append(wait_healthy(process, url, log, startup_timeout_s))
                latency_summary(url, math.inf, warmup, seed=0)
                for rate in rates:
                    row = latency_summary(url, rate, requests, seed=11)
                    per_rate[engine][rate].append(row)
                    print(f"[serving] {engine} {rate:g} req/s: TTFT p50 "
                          f"{row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms, "
                          f"ITL p50 {row['itl_p50_ms']:.0f} ms p99 {row['itl_p99_ms']:.0f} ms",
                          flush=True)
            finally:
                stop_server(process)
    rows = [ServingRow(rate, pooled_latency(per_rate["loragate"][rate]),
                       pooled_latency(per_rate["vllm"][rate])) for rate in rates]
    return rows, startup
