"""OpenMP's wait policy on a CPU host: libgomp's default (threads spin about 300,000 times
at each barrier), loragate's default (3,000 spins, engine/openmp_env.py) and
``OMP_WAIT_POLICY=PASSIVE`` (threads sleep at once), on a quiet host and on one where
another process keeps a core busy, measured side by side.

    python -m benchmarks.omp_wait_policy [--model DIR] [--max-tokens 128] [--configs ...]

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


CONFIGS = {"default": {}, "libgomp": {"GOMP_SPINCOUNT": "300000"},
           "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
"""Named OpenMP environments: ``default`` is what `loragate serve` does unless told
(engine/openmp_env.py: GOMP_SPINCOUNT=3000); ``libgomp`` is the runtime's own default
(300,000 spins); ``passive`` sleeps at once; ``spin:N`` is GOMP_SPINCOUNT=N."""
OMP_NAMES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def config_env(name: str) -> dict[str, str]:
    """The OpenMP environment of a configuration name (see CONFIGS)."""
    if name.startswith("spin:"):
        return {"GOMP_SPINCOUNT": str(int(name.removeprefix("spin:")))}
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}: {', '.join(CONFIGS)} or spin:N")
    return CONFIGS[name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the default model)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--configs", default="libgomp,default,passive",
                        help="comma-separated: default, libgomp, passive, spin:N "
                             "(GOMP_SPINCOUNT=N); ratios are against the first")
    args = parser.parse_args()
    model = args.model or str(default_model_dir())
    name = Path(model).name
    configs = {label: config_env(label) for label in args.configs.split(",")}
    results: dict[tuple[str, str], tuple[float, float]] = {}
    saved = {key: os.environ.get(key) for key in OMP_NAMES}
    with tempfile.TemporaryDirectory() as log_dir:
        for label, env in configs.items():
            for key in OMP_NAMES:
                os.environ.pop(key, None)
            os.environ.update(env)
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
    for key, value in saved.items():
        os.environ.pop(key, None)
        if value is not None:
            os.environ[key] = value
    print(f"cores: {len(os.sched_getaffinity(0))}")
    first = next(iter(configs))
    for label in list(configs)[1:]:
        for host in ("quiet", "one core busy"):
            (base_itl, base_rate), (itl, rate) = results[first, host], results[label, host]
            print(f"{label} vs {first}, {host:<14}: ITL {itl / base_itl:5.2f}x, "
                  f"burst throughput {rate / base_rate:5.2f}x")


if __name__ == "__main__":
    main()
