"""Small HTTP helpers for tests against live engine and gateway processes (tests/live_servers).

Waiting is always polling a condition against a deadline: `poll` fails the test with the last
value it saw when the deadline passes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

T = TypeVar("T")
DEADLINE_S = 30.0


def poll(check: Callable[[], T | None], what: str, timeout_s: float = DEADLINE_S,
         interval_s: float = 0.02) -> T:
    """Call check() until it returns something truthy (returned) or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
        except httpx.HTTPError as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}; last "
                                 f"seen: {last!r}")
        time.sleep(interval_s)


def engine_state(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/state", timeout=5.0)
    response.raise_for_status()
    return dict(response.json())


def engine_is_idle(url: str) -> bool:
    """Nothing running or queued, and every KV block back (free or cached)."""
    s = engine_state(url)
    return (s["num_running"], s["num_waiting"], s["num_swapped"], s["kv_blocks_used"]) == (
        0, 0, 0, 0)


def wait_engines_idle(*urls: str) -> None:
    for url in urls:
        poll(functools.partial(engine_is_idle, url), f"{url} to be idle (no requests, no KV "
             f"blocks used)")


def instances(gateway_url: str, admin_key: str | None = None) -> dict[str, dict[str, Any]]:
    """GET /instances of a gateway, keyed by instance id (the engine's URL); a gateway with
    an admin key needs it."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    response = httpx.get(gateway_url + "/instances", timeout=5.0, headers=headers)
    response.raise_for_status()
    return {i["instance_id"]: i for i in response.json()}


def served_by(response: httpx.Response) -> str:
    """The engine URL of a gateway response's route (gateways with --debug-headers true);
    the x-loragate-instance header names it only by an opaque id."""
    match = re.search(r"\binstance=(\S+)", response.headers["x-loragate-route"])
    assert match is not None, response.headers["x-loragate-route"]
    return match.group(1)


def sse_events(response: httpx.Response) -> Iterator[Any]:
    """The data payloads of an SSE response: parsed JSON, or the string "[DONE]"."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def route_reason(response: httpx.Response) -> str:
    """The `reason=` of the gateway's x-loragate-route header."""
    match = re.search(r"\breason=(\S+)", response.headers["x-loragate-route"])
    assert match is not None, response.headers["x-loragate-route"]
    return match.group(1)


def route_scores(response: httpx.Response) -> dict[str, float]:
    """The per-instance scores of the gateway's x-loragate-route header."""
    text = response.headers["x-loragate-route"].split(" scores=", 1)[1]
    return {k: float(v) for k, v in (part.rsplit("=", 1) for part in text.split(","))}


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples of `name` whose labels include `labels` (0.0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        sample, value = line.rsplit(" ", 1)
        found = dict(re.findall(r'(\w+)="([^"]*)"', sample))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The error object of an OpenAI-style error body (which holds nothing else)."""
    payload = response.json()
    assert set(payload) == {"error"}, payload
    return dict(payload["error"])


@dataclass
class StreamResult:
    """What stream_into saw of one streamed response."""

    status: int = 0
    instance: str = ""
    events: list[Any] = field(default_factory=list)
    truncated: bool = False
    """The connection closed before the response's end (no error event, no [DONE])."""


async def stream_into(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                      result: StreamResult) -> None:
    """POST payload and collect the SSE events into result as they come (a test can watch
    result while the stream runs)."""
    async with client.stream("POST", url, json=payload) as response:
        result.status = response.status_code
        result.instance = response.headers.get("x-loragate-instance", "")
        try:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    result.events.append(data if data == "[DONE]" else json.loads(data))
        except httpx.RemoteProtocolError:
            result.truncated = True


async def until_async(check: Callable[[], Any], what: str,
                      timeout_s: float = DEADLINE_S) -> None:
    """poll for a coroutine: yields to the event loop between checks."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
