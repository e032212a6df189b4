"""OpenMP's wait policy on a CPU host: the default (threads spin at each barrier) against
``OMP_WAIT_POLICY=PASSIVE`` (threads sleep), on a quiet host and on one where another
process keeps a core busy, measured side by side.

    python -m benchmarks.omp_wait_policy [--model DIR] [--max-tokens 128]

Each configuration is a fresh `loragate serve` (the real default model unless --model) in
the policy's environment. Per host condition it reports one greedy stream's inter-token
latency (the mean gap between content events after the first) and a burst of 8
concurrent requests' output tokens per second. Spinning wins while every torch thread has
a core to itself; when a core is taken, a thread spinning at a barrier waits for a sibling
that is not running, and sleeping threads give the core back.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.gateway_process import start_gateway, stop_gateway
from benchmarks.serve_instances import burst
from engine.default_model import default_model_dir


def stream_itl(url: str, model: str, max_tokens: int) -> float:
    """Milliseconds between a greedy stream's content events, after the first."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "Write a long story "
                                          "about a dragon who learns to cook."}]}
    stamps = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as events:
        events.raise_for_status()
        for line in events.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.monotonic())
    return 1000 * (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def measure(url: str, model: str, max_tokens: int) -> tuple[float, float]:
    """(stream ITL in ms, burst output tokens per second)."""
    itl = stream_itl(url, model, max_tokens)
    seconds, tokens = burst(url, model, 8, 32)
    return itl, tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the default model)")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    model = args.model or str(default_model_dir())
    name = Path(model).name
    policies = {"default (spin)": None, "PASSIVE": "PASSIVE"}
    results: dict[tuple[str, str], tuple[float, float]] = {}
    saved = os.environ.get("OMP_WAIT_POLICY")
    with tempfile.TemporaryDirectory() as log_dir:
        for label, policy in policies.items():
            os.environ.pop("OMP_WAIT_POLICY", None)
            if policy is not None:
                os.environ["OMP_WAIT_POLICY"] = policy
            gateway = start_gateway(model, [], {}, Path(log_dir))
            try:
                burst(gateway.url, name, 2, 4)  # warm-up: first-call costs out of the figure
                for host in ("quiet", "one core busy"):
                    hog = None if host == "quiet" else subprocess.Popen(
                        [sys.executable, "-c", "while True: pass"])
                    try:
                        results[label, host] = measure(gateway.url, name, args.max_tokens)
                    finally:
                        if hog is not None:
                            hog.kill()
                            hog.wait()
                    itl, rate = results[label, host]
                    print(f"{label:<16} {host:<14} stream ITL {itl:6.1f} ms   burst "
                          f"{rate:6.1f} output tok/s", flush=True)
            finally:
                stop_gateway(gateway)
    if saved is not None:
        os.environ["OMP_WAIT_POLICY"] = saved
    print(f"cores: {len(os.sched_getaffinity(0))}")
    for host in ("quiet", "one core busy"):
        (spin_itl, spin_rate), (passive_itl, passive_rate) = (
            results["default (spin)", host], results["PASSIVE", host])
        print(f"PASSIVE vs default, {host:<14}: ITL {passive_itl / spin_itl:5.2f}x, "
              f"burst throughput {passive_rate / spin_rate:5.2f}x")


if __name__ == "__main__":
    main()
