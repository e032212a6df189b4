"""Reliability under overload, faults and disconnects, counted. Loopback only.

    python -m benchmarks.reliability --model DIR [--quick] [--soak-s 600]

Two engine processes, a private redis-server and the gateway (on that Redis) in front:
1. overload: --overload-x times the measured sustainable rate for --overload-s seconds.
   Every request must end in a completion or a 429/503; counts sent / completed / rejected /
   errors / lost (no answer within the client timeout), p99 latency of the admitted ones.
2. faults, under a load the instances sustain: one engine SIGKILLed and restarted on its port,
   Redis stopped and started; the same counts.
3. disconnects: --disconnects streams dropped at random points.
4. soak (with --soak-s): 70% of the sustainable rate, engine RSS sampled; reports its drift.
5. adversarial (benchmarks/adversarial.py): --hangups streams reset mid-request while two
   clients keep the engines in long prefills; hostile parameters, a 2 MB prompt and 8 MB
   bodies of tiny content parts beside a victim stream, and a flood of slow new grammars
   beside another client's new schema. Engines must stay alive, victims
   clean, no stall over 1 s.
After each part: every engine must be idle with zero KV blocks in use (leaks are counted).
`--parts` picks some of overload, faults, disconnects, adversarial (default all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks import adversarial
from benchmarks.gateway_process import start_gateway, stop_gateway
from engine.config import EngineConfig
from gateway.serve import EngineProcess, free_port, start_engines, stop_engines, wait_ready

DEFAULT_OUT = Path(__file__).parent / "results" / "reliability.json"


async def one_request(client: httpx.AsyncClient, model: str, rng: random.Random,
                      outcomes: Counter[str], latencies: list[float], timeout_s: float) -> None:
    prompt = [rng.randrange(10, 4000) for _ in range(rng.randint(32, 256))]
    body = {"model": model, "prompt": prompt,
            "max_tokens": rng.randint(8, 48), "ignore_eos": True, "stream": True}
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    outcomes["rejected" if response.status_code in (429, 503)
                             else f"http {response.status_code}"] += 1
                    return
                events = [line[len("data: "):] async for line in response.aiter_lines()
                          if line.startswith("data: ")]
        # Parsed, not searched: a generated token can be the text "error" itself.
        if any(e != "[DONE]" and "error" in json.loads(e) for e in events):
            outcomes["error event"] += 1
        elif events and events[-1] == "[DONE]":
            outcomes["completed"] += 1
            latencies.append(time.monotonic() - start)
        else:
            outcomes["lost (stream ended without [DONE])"] += 1
    except TimeoutError:
        outcomes["lost (hung)"] += 1
    except httpx.HTTPError as exc:
        outcomes[f"transport {type(exc).__name__}"] += 1


async def load(url: str, model: str, rate: float, seconds: float, seed: int,
               events: Sequence[tuple[float, Any]] | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    latencies: list[float] = []
    pending = sorted(events or [], key=lambda e: e[0])
    async with httpx.AsyncClient(base_url=url, timeout=None,
                                 limits=httpx.Limits(max_connections=2000)) as client:
        tasks = []
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            while pending and pending[0][0] <= elapsed:
                pending.pop(0)[1]()
            tasks.append(asyncio.create_task(one_request(client, model, rng, outcomes,
                                                         latencies, 300.0)))
            await asyncio.sleep(rng.expovariate(rate))
        for _, action in pending:
            action()
        await asyncio.gather(*tasks)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0
    return {"sent": len(tasks), "outcomes": dict(outcomes), "admitted_p99_s": p99}


def leaks(engines: list[EngineProcess]) -> dict[str, int]:
    """KV blocks still in use per engine once it is idle (should all be 0)."""
    found = {}
    with httpx.Client(timeout=10.0) as client:
        for engine in engines:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                state = client.get(engine.url + "/state").json()
                if state["num_running"] == state["num_waiting"] == 0:
                    break
                time.sleep(0.2)
            found[engine.url] = int(client.get(engine.url + "/state").json()["kv_blocks_used"])
    return found


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--quick", action="store_true", help="10 s parts, 100 disconnects")
    parser.add_argument("--overload-x", type=float, default=10.0)
    parser.add_argument("--overload-s", type=float, default=60.0)
    parser.add_argument("--fault-s", type=float, default=60.0)
    parser.add_argument("--disconnects", type=int, default=1000)
    parser.add_argument("--soak-s", type=float, default=0.0)
    parser.add_argument("--hangups", type=int, default=200,
                        help="streams reset mid-request in the adversarial part")
    parser.add_argument("--parts", default="overload,faults,disconnects,adversarial",
                        help="comma-separated subset of overload,faults,disconnects,"
                             "adversarial")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.overload_s, args.fault_s, args.disconnects = 10.0, 20.0, 100
        args.hangups = 50
    parts = set(args.parts.split(","))
    log_dir = Path(tempfile.mkdtemp(prefix="loragate-reliability-"))
    redis_port = free_port()
    redis_cmd = ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly",
                 "yes", "--dir", str(log_dir)]
    redis = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL)
    config = EngineConfig(model=args.model, max_num_seqs=32, max_num_batched_tokens=512)
    engines = start_engines(config, 2, log_dir, {})
    gateway = None
    report: dict[str, Any] = {}
    try:
        wait_ready(engines, 300)
        gateway = start_gateway(args.model, [e.url for e in engines], {}, log_dir,
                                "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
                                "--max-in-flight-per-instance", "32")
        model = httpx.get(gateway.url + "/v1/models").json()["data"][0]["id"]
        t0 = time.monotonic()
        calib = asyncio.run(load(gateway.url, model, 50.0, 2.0, seed=1))
        sustainable = calib["outcomes"].get("completed", 1) / (time.monotonic() - t0)
        report["sustainable_rps"] = sustainable
        print(f"sustainable rate ~{sustainable:.2f} req/s", flush=True)

        if "overload" in parts:
            rate = args.overload_x * sustainable
            report["overload"] = asyncio.run(load(gateway.url, model, rate, args.overload_s, 2))
            report["overload"]["rate"] = rate
            report["overload"]["leaked_blocks"] = leaks(engines)
            print("overload:", report["overload"], flush=True)

        victim = engines[1]
        port = int(victim.url.rsplit(":", 1)[1])

        def kill() -> None:
            victim.process.send_signal(signal.SIGKILL)

        def restart() -> None:
            command = [sys.executable, "-m", "engine.http", "--model", args.model,
                       "--port", str(port), "--max-num-seqs", "32"]
            victim.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.STDOUT)

        redis_box = {"process": redis}

        def redis_stop() -> None:
            redis_box["process"].terminate()

        def redis_start() -> None:
            redis_box["process"] = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL)

        if "faults" in parts:
            s = args.fault_s
            events = [(0.2 * s, kill), (0.4 * s, restart), (0.6 * s, redis_stop),
                      (0.8 * s, redis_start)]
            report["faults"] = asyncio.run(load(gateway.url, model, 0.7 * sustainable, s, 3,
                                                events))
            wait_ready(engines, 300)
            report["faults"]["leaked_blocks"] = leaks(engines)
            print("faults:", report["faults"], flush=True)
            redis = redis_box["process"]

        async def disconnects() -> Counter[str]:
            rng = random.Random(4)
            seen: Counter[str] = Counter()
            async with httpx.AsyncClient(base_url=gateway.url if gateway else "",
                                         timeout=120) as client:
                async def drop() -> None:
                    body = {"model": model, "prompt": [rng.randrange(10, 4000)] * 64,
                            "max_tokens": 64, "ignore_eos": True, "stream": True}
                    cut = rng.randint(0, 10)
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        seen[str(r.status_code)] += 1
                        n = 0
                        async for _ in r.aiter_lines():
                            n += 1
                            if n >= cut:
                                break
                for start in range(0, args.disconnects, 20):
                    await asyncio.gather(*(drop() for _ in range(min(20, args.disconnects
                                                                     - start))))
            return seen

        if "disconnects" in parts:
            report["disconnects"] = {"sent": args.disconnects,
                                     "statuses": dict(asyncio.run(disconnects())),
                                     "leaked_blocks": leaks(engines)}
            print("disconnects:", report["disconnects"], flush=True)

        if "adversarial" in parts:
            report["adversarial"] = adversarial.run(gateway.url, model, args.hangups)
            report["adversarial"]["engines_alive"] = sum(
                e.process.poll() is None and httpx.get(e.url + "/health").status_code == 200
                for e in engines)
            report["adversarial"]["leaked_blocks"] = leaks(engines)
            print("adversarial:", json.dumps(report["adversarial"]), flush=True)

        if args.soak_s > 0:
            samples: list[tuple[float, int]] = []
            pid = engines[0].process.pid
            events_soak = [(t, (lambda t=t: samples.append((t, rss_kb(pid)))))
                           for t in range(0, int(args.soak_s), 30)]
            report["soak"] = asyncio.run(load(gateway.url, model, 0.7 * sustainable,
                                              args.soak_s, 5, events_soak))
            report["soak"]["rss_kb"] = samples
            report["soak"]["leaked_blocks"] = leaks(engines)
            print("soak:", report["soak"], flush=True)
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        stop_engines(engines, 30)
        redis.terminate()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
