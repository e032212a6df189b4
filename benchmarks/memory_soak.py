"""Server memory under a long mixed workload: does its RSS level off or keep growing?

    python -m benchmarks.memory_soak [--model DIR] [--requests 3000] [--concurrency 4]
        [--sample-every 100] [--engine-process] [--port P] [--out FILE]

Starts `loragate serve` (the real default model unless --model; no state file, no demo
adapters) and sends --requests requests, --concurrency at a time, the kinds in turn: a short
chat, a completion with logprobs and echo, a chat stream with include_usage, a stream the
client hangs up after 3 chunks, a chat held to a JSON schema (four schemas in turn, so the
grammar cache fills and is reused), a chat with n=2 at temperature 0.8, and /v1/responses.

VmRSS (/proc/PID/status) of the server and of every process under it (the engine with
--engine-process, the grammar helper once a schema came) is read once it is ready and then
every --sample-every finished requests, with its parts: RssAnon (the heap: what a leak
grows), RssShmem (the KV cache, a shared anonymous map whose pages count once first written,
so it grows up to the cache's size) and RssFile (libraries and weights, which the kernel
drops and reads back as the host's memory comes and goes). Per process, for VmRSS and for
RssAnon: the growth over the first half of its series and over the second, and a verdict:
"levels off" when the second half grew by under 2% of the value at the middle, else "still
growing". A request fails on a status other than 200, a transport error, an error event, or
an answer without what it asked for; any failure makes the exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from benchmarks.gateway_process import spawn_server, stop_gateway
from benchmarks.serving_client import discover_model
from benchmarks.structured_schemas import schema_cases
from engine.default_model import default_model_dir
from gateway.serve import EngineProcess, free_port

LEVELS_OFF_PCT = 2.0
"""A second half that grew by less than this share of the RSS levels off."""
HANG_UP_AFTER = 3
"""Chunks the hang-up kind reads before it closes the connection."""
SCHEMAS = schema_cases()[:4]

Point = tuple[int, int, int, int, int]
"""(requests finished, VmRSS, RssAnon, RssShmem, RssFile), the sizes in kB."""
PARTS = ("VmRSS", "RssAnon", "RssShmem", "RssFile")
Send = Callable[[httpx.AsyncClient, str, int], Coroutine[Any, Any, None]]


class Failed(Exception):
    """The answer came but lacks what the request asked for."""


def _chat(i: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"Tell me fact number {i} about the sea."}],
            "max_tokens": 16, "temperature": 0, **extra}


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(path, json=body)
    if response.status_code != 200:
        raise Failed(f"http {response.status_code}")
    answer: dict[str, Any] = response.json()
    return answer


async def _events(client: httpx.AsyncClient, body: dict[str, Any], stop_after: int | None
                  ) -> list[dict[str, Any]]:
    """A chat stream's parsed events up to [DONE] (or the first stop_after of them, then the
    connection is closed)."""
    events: list[dict[str, Any]] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise Failed(f"http {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[len("data: "):]))
            if "error" in events[-1]:
                raise Failed("error event")
            if stop_after is not None and len(events) >= stop_after:
                return events
    raise Failed("stream ended without [DONE]")


async def chat(client: httpx.AsyncClient, model: str, i: int) -> None:
    answer = await _post(client, "/v1/chat/completions", _chat(i, model=model))
    if answer["choices"][0]["message"]["content"] is None:
        raise Failed("no content")


async def completion_logprobs_echo(client: httpx.AsyncClient, model: str, i: int) -> None:
    answer = await _post(client, "/v1/completions", {
        "model": model, "prompt": f"The {i}th wave reached the shore and", "max_tokens": 8,
        "logprobs": 2, "echo": True, "ignore_eos": True, "temperature": 0})
    usage, logprobs = answer["usage"], answer["choices"][0]["logprobs"]
    if len(logprobs["tokens"]) != usage["prompt_tokens"] + usage["completion_tokens"]:
        raise Failed("echoed logprobs do not cover prompt and completion")


async def stream_with_usage(client: httpx.AsyncClient, model: str, i: int) -> None:
    events = await _events(client, _chat(i, model=model, stream=True,
                                         stream_options={"include_usage": True}), None)
    if not events or not events[-1].get("usage"):
        raise Failed("no usage chunk")


async def stream_hang_up(client: httpx.AsyncClient, model: str, i: int) -> None:
    body = _chat(i, model=model, stream=True, max_tokens=64, ignore_eos=True)
    if len(await _events(client, body, HANG_UP_AFTER)) < HANG_UP_AFTER:
        raise Failed("stream ended before the hang-up")


async def json_schema(client: httpx.AsyncClient, model: str, i: int) -> None:
    case = SCHEMAS[i % len(SCHEMAS)]
    answer = await _post(client, "/v1/chat/completions", {
        "model": model, "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "user", "content": case.requests[i % len(case.requests)]}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": case.name, "schema": case.schema}}})
    choice = answer["choices"][0]
    if choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])  # a ValueError fails the request


async def chat_n2(client: httpx.AsyncClient, model: str, i: int) -> None:
    answer = await _post(client, "/v1/chat/completions",
                         _chat(i, model=model, n=2, temperature=0.8))
    if len(answer["choices"]) != 2:
        raise Failed("n=2 gave another number of choices")


async def responses(client: httpx.AsyncClient, model: str, i: int) -> None:
    answer = await _post(client, "/v1/responses", {
        "model": model, "input": f"Name {i % 10 + 1} fish.", "max_output_tokens": 16,
        "temperature": 0})
    if answer["status"] not in ("completed", "incomplete") or not answer["output"]:
        raise Failed(f"response status {answer['status']}")


KINDS: dict[str, Send] = {
    "chat": chat, "completion_logprobs_echo": completion_logprobs_echo,
    "stream_with_usage": stream_with_usage, "stream_hang_up": stream_hang_up,
    "json_schema": json_schema, "chat_n2": chat_n2, "responses": responses}


def rss_kb(pid: int) -> tuple[int, int, int, int] | None:
    """The PARTS of a process's resident memory in kB; None once it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie
        return None
    vm, anon, shmem, file = (int(fields[part].split()[0]) for part in PARTS)
    return vm, anon, shmem, file


def process_tree(root: int) -> dict[int, str]:
    """root and every process under it, each named by its `-m` module (else its command)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else Path(argv[0]).name
        found[pid] = f"{module} {pid}"
        todo += children.get(pid, [])
    return found


def sample(root: int, done: int, series: dict[str, list[Point]]) -> None:
    """Append a point to the series of every process under root."""
    read = []
    for pid, label in process_tree(root).items():
        if (kb := rss_kb(pid)) is not None:
            series.setdefault(label, []).append((done, *kb))
            read.append(f"{label} {kb[0] / 1024:.1f} MiB")
    print(f"{done} requests: " + ", ".join(read), flush=True)


def verdict(points: list[tuple[int, int]]) -> dict[str, Any]:
    """Growth over the first and second half of one series of (requests finished, kB)."""
    if len(points) < 3:
        return {"verdict": "too few samples"}
    (_, first), (mid_at, mid), (_, last) = points[0], points[len(points) // 2], points[-1]
    second_pct = 100 * (last - mid) / mid
    return {"start_kb": first, "middle_kb": mid, "end_kb": last, "middle_at": mid_at,
            "first_half_mib": (mid - first) / 1024, "first_half_pct": 100 * (mid - first) / first,
            "second_half_mib": (last - mid) / 1024, "second_half_pct": second_pct,
            "verdict": "levels off" if second_pct < LEVELS_OFF_PCT else "still growing"}


async def soak(url: str, root: int, requests: int, concurrency: int, every: int
               ) -> dict[str, Any]:
    """Send the mixed workload; the RSS series of each process and the failures."""
    series: dict[str, list[Point]] = {}
    failures: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    kinds = list(KINDS.items())
    queue = iter(range(requests))
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as client:
        model = await discover_model(client, url)
        sample(root, 0, series)

        async def worker() -> None:
            nonlocal done
            for i in queue:
                name, send = kinds[i % len(kinds)]
                sent[name] += 1
                try:
                    await send(client, model, i)
                except Failed as exc:
                    failures[f"{name}: {exc}"] += 1
                except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                    failures[f"{name}: {type(exc).__name__}"] += 1
                done += 1
                if done % every == 0:
                    sample(root, done, series)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"model": model, "seconds": time.monotonic() - start, "sent": dict(sent),
            "failed": sum(failures.values()), "failures": dict(failures), "rss_kb": series}


def start_server(model: str, port: int, engine_process: bool, log_dir: Path) -> EngineProcess:
    """`loragate serve` on the model as a child process, waited for until ready."""
    command = [sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--port",
               str(port), "--state-path", "", *(["--engine-process"] if engine_process else [])]
    return spawn_server(command, port, log_dir / f"serve-{port}.log",
                        dict(os.environ, LORAGATE_DEMO_ADAPTERS="0"), ready_s=300)


def verdicts(series: dict[str, list[Point]]) -> dict[str, dict[str, Any]]:
    """Per process, the verdict on its VmRSS and on its RssAnon."""
    return {label: {"vmrss": verdict([(p[0], p[1]) for p in points]),
                    "rss_anon": verdict([(p[0], p[2]) for p in points])}
            for label, points in series.items()}


def _growth(name: str, v: dict[str, Any]) -> str:
    if "start_kb" not in v:
        return f"{name} {v['verdict']}"
    return (f"{name} {v['start_kb'] / 1024:.1f} -> {v['middle_kb'] / 1024:.1f} (at "
            f"{v['middle_at']}) -> {v['end_kb'] / 1024:.1f} MiB; first half "
            f"{v['first_half_mib']:+.1f} MiB ({v['first_half_pct']:+.2f}%), second half "
            f"{v['second_half_mib']:+.1f} MiB ({v['second_half_pct']:+.2f}%): {v['verdict']}")


def report(result: dict[str, Any]) -> None:
    series: dict[str, list[Point]] = result["rss_kb"]
    labels = list(series)
    print("MiB: VmRSS = RssAnon + RssShmem + RssFile")
    print("requests  " + "  ".join(f"{label:>39}" for label in labels))
    by_label = {label: {p[0]: p[1:] for p in points} for label, points in series.items()}
    for done in sorted({point[0] for points in series.values() for point in points}):
        cells = ("".join(f"{kb / 1024:{9 if i else 12}.1f}" for i, kb in
                         enumerate(by_label[label][done]))
                 if done in by_label[label] else " " * 39 for label in labels)
        print(f"{done:8d}  " + "  ".join(cells))
    for label, v in result["verdicts"].items():
        print(f"{label}: {_growth('VmRSS', v['vmrss'])}\n"
              f"{' ' * len(label)}  {_growth('RssAnon', v['rss_anon'])}")
    print(f"{sum(result['sent'].values())} requests in {result['seconds']:.0f} s; failed: "
          f"{result['failed']} {result['failures'] or ''}".rstrip(), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the default model)")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--engine-process", action="store_true",
                        help="the engine in a child process (its RSS sampled too)")
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--out", type=Path, default=None, help="write everything as JSON")
    args = parser.parse_args(argv)
    for name in ("requests", "concurrency", "sample_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not "
                         f"{getattr(args, name)}")
    model = args.model or str(default_model_dir())
    if not Path(model).is_dir():
        parser.error(f"no model at {model}: pass --model DIR or run "
                     "`loragate fetch-default-model`")
    with tempfile.TemporaryDirectory(prefix="memory-soak-") as log_dir:
        server = start_server(model, args.port or free_port(), args.engine_process,
                              Path(log_dir))
        try:
            result = asyncio.run(soak(server.url, server.process.pid, args.requests,
                                      args.concurrency, args.sample_every))
        finally:
            stop_gateway(server)
    result["verdicts"] = verdicts(result["rss_kb"])
    result["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
