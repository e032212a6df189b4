"""Engines per machine: `loragate serve --instances N` with the cores split between its
engines (the default) against every engine taking every core, measured side by side.

    python -m benchmarks.serve_instances [--model DIR] [--requests 16] [--max-tokens 32]

Each configuration is a fresh `loragate serve` (the real default model unless --model),
sent one burst of concurrent chat requests (distinct prompts, greedy, a fixed length); it
reports the burst's wall time and output tokens per second, and the ratios against one
instance. On a CPU box, N engines that each start one torch thread per core run N times
as many threads as cores: a thread preempted mid-matmul stalls its siblings at the next
barrier, which made two engines on two cores far slower than one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.gateway_process import start_gateway, stop_gateway
from engine.default_model import default_model_dir


def burst(url: str, model: str, requests: int, max_tokens: int) -> tuple[float, int]:
    """Wall seconds for `requests` concurrent chat completions, and the tokens they made."""
    def one(index: int) -> int:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Tell me fact number {index} "
                              f"about the sea."}]}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return time.monotonic() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the default model)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model = args.model or str(default_model_dir())
    name = Path(model).name
    cores = len(os.sched_getaffinity(0))
    configs = [("1 instance", ["--instances", "1", "--engine-process"]),
               ("2 instances, cores split (default)", ["--instances", "2"]),
               (f"2 instances, {cores} threads each", ["--instances", "2",
                                                       "--cpu-threads", str(cores)])]
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as log_dir:
        for label, flags in configs:
            gateway = start_gateway(model, [], {}, Path(log_dir), *flags)
            try:
                burst(gateway.url, name, 2, 4)  # warm-up: first-call costs out of the figure
                seconds, tokens = burst(gateway.url, name, args.requests, args.max_tokens)
            finally:
                stop_gateway(gateway)
            results[label] = seconds
            print(f"{label:<40} {seconds:7.1f} s  {tokens / seconds:7.1f} output tok/s",
                  flush=True)
    one = results[configs[0][0]]
    print(f"cores: {cores}; {args.requests} concurrent requests x {args.max_tokens} tokens")
    for label, seconds in results.items():
        print(f"wall time vs 1 instance: {label:<40} {seconds / one:5.2f}x")


if __name__ == "__main__":
    main()
