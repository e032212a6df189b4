"""Freezing the startup heap (engine/http/draining.py, ``freeze_startup_heap``) against
leaving it to the collector, side by side: the oldest generation's collections while
serving, the stream gaps clients see, and how long an idle server takes to exit.

    python -m benchmarks.heap_freeze [--model DIR] [--rounds 3] [--streams 8]

Each configuration is a fresh `loragate serve` (the real default model unless --model),
started through this module so a ``gc.callbacks`` hook can time every collection of the
oldest generation inside the server; the ``thawed`` configuration replaces the freeze with
nothing. Per configuration: ``--streams`` concurrent greedy chat streams, ``--rounds``
times, then a SIGTERM to the idle server. Configurations alternate (A B A B) so drift on a
shared host lands on both.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from engine.default_model import default_model_dir
from gateway.serve import EngineProcess, free_port, wait_ready

CONFIGS = ("frozen", "thawed")


def child(config: str, stats_path: str, serve_args: list[str]) -> None:
    """Run `loragate serve` in this process, timing the oldest generation's collections
    (wall-clock start, seconds) and writing them to stats_path at exit."""
    pauses: list[tuple[float, float]] = []
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.time(), time.perf_counter() - started[0]))

    gc.callbacks.append(on_gc)
    if config == "thawed":
        import engine.http.draining as draining
        draining.freeze_startup_heap = lambda: 0

    def write() -> None:  # atexit runs before the interpreter's own final collections
        Path(stats_path).write_text(json.dumps({"pauses": pauses,
                                                "frozen": gc.get_freeze_count(),
                                                "exited_at": time.time()}))

    atexit.register(write)
    from gateway.cli import main
    sys.exit(main(["serve", *serve_args]))


async def stream_gaps(client: httpx.AsyncClient, url: str, model: str, index: int,
                      max_tokens: int) -> list[float]:
    """Seconds between one greedy stream's content events."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": f"Tell me fact number "
                                          f"{index} about the sea."}]}
    stamps: list[float] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as events:
        events.raise_for_status()
        async for line in events.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.monotonic())
    return [b - a for a, b in itertools.pairwise(stamps)]


async def load(url: str, model: str, rounds: int, streams: int, max_tokens: int
               ) -> list[float]:
    gaps: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        for round_index in range(rounds):
            results = await asyncio.gather(*(
                stream_gaps(client, url, model, round_index * streams + i, max_tokens)
                for i in range(streams)))
            gaps += [gap for result in results for gap in result]
    return gaps


def run_config(config: str, model: str, name: str, args: argparse.Namespace,
               log_dir: Path) -> dict[str, Any]:
    port = free_port()
    stats = log_dir / f"{config}-{port}.json"
    command = [sys.executable, "-m", "benchmarks.heap_freeze", "--child", config, str(stats),
               "--", "--model", model, "--port", str(port), "--state-path", ""]
    env = dict(os.environ, LORAGATE_DEMO_ADAPTERS="0")
    log = log_dir / f"{config}-{port}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = EngineProcess(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_ready([server], 300)
        began = time.time()
        gaps = asyncio.run(load(server.url, name, args.rounds, args.streams, args.max_tokens))
        ended = time.time()
        time.sleep(1.0)  # idle, as a server being stopped usually is
        stop_sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(120)
        exit_s = time.monotonic() - stop_sent
    finally:
        if process.poll() is None:
            process.kill()
    record = json.loads(stats.read_text())
    during = [pause for at, pause in record["pauses"] if began <= at <= ended]
    gaps.sort()
    return {"config": config, "frozen_objects": record["frozen"],
            "gen2_collections": len(during), "gen2_pause_total_ms": 1000 * sum(during),
            "gen2_pause_max_ms": 1000 * max(during, default=0.0),
            "gap_p50_ms": 1000 * statistics.median(gaps),
            "gap_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
            "gap_max_ms": 1000 * gaps[-1], "load_s": ended - began, "exit_s": exit_s}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[5:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="A B pairs")
    args = parser.parse_args()
    model = args.model or str(default_model_dir())
    name = Path(model).name
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="heap-freeze-") as tmp:
        for _ in range(args.repeats):
            for config in CONFIGS:
                row = run_config(config, model, name, args, Path(tmp))
                rows.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)

    def median(config: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["config"] == config)

    print(f"\n{name}, {args.repeats} pair(s), {args.rounds} rounds of {args.streams} streams "
          f"x {args.max_tokens} tokens (medians, thawed / frozen):")
    for key in ("gen2_collections", "gen2_pause_total_ms", "gen2_pause_max_ms", "gap_p99_ms",
                "gap_max_ms", "load_s", "exit_s"):
        thawed, frozen = median("thawed", key), median("frozen", key)
        ratio = f"{thawed / frozen:.2f}x" if frozen else "-"
        print(f"  {key:22s} thawed {thawed:9.1f}  frozen {frozen:9.1f}  {ratio}")


if __name__ == "__main__":
    main()
