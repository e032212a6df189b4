"""The scale rehearsal's client load (tests/test_scale_rehearsal_live.py): threads sending
small completions, streamed and not, alternately to each gateway of a Cluster, every
request's outcome recorded and classified (complete, refused with Retry-After, interrupted
mid-stream by a dead engine, or failed), plus probe bursts that show which engines a gateway
routes to.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.exposure import instance_tag
from tests.live_http import poll
from tests.live_servers import LiveServer
from tests.rehearsal_cluster import ADMIN_KEY, MODEL, Cluster

CLIENT_THREADS = 3
THINK_S = 0.05
"""Pause between one thread's requests: the load must leave CPU for engines to start (an
engine loads in ~5 s alone on 2 cores, ~30 s under a saturating load)."""
MAX_TOKENS = 8
PROBE_BURST = 5
"""Concurrent requests per probe: the router spreads a burst by in-flight load, so a burst
reaches every healthy engine (one request at a time would follow the score's tie-break)."""


@dataclass
class Outcome:
    at: float
    gateway: str
    stream: bool
    kind: str
    """"ok" (200, complete), "refused" (503/429 with Retry-After) or "failed"."""
    engine: str = ""
    """The x-loragate-instance tag of the engine that served it (see tag())."""
    detail: str = ""
    ready_engines: int = 0


class Load:
    """Client threads sending small completions alternately to each gateway, streamed and
    not, until stopped; every request's outcome is recorded."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True)
                        for n in range(CLIENT_THREADS)]
        self.count = 0

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)
        assert not any(t.is_alive() for t in self.threads), "a client thread hung"

    def _run(self, n: int) -> None:
        with httpx.Client(timeout=30.0) as client:
            i = 0
            while not self.stopping.is_set():
                gateway = self.cluster.gateways[(n + i) % len(self.cluster.gateways)]
                self.record(request(client, gateway.url, self.cluster.tenant_key,
                                    stream=(n + i // 2) % 2 == 0,
                                    prompt=f"thread {n} request {i}: say something",
                                    ready=lambda: self.cluster.ready_engines))
                i += 1
                self.stopping.wait(THINK_S)

    def record(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def since(self, t: float) -> list[Outcome]:
        with self.lock:
            return [o for o in self.outcomes if o.at >= t]


def tag(url: str) -> str:
    """The opaque id gateways name an engine by in x-loragate-instance (the same on both:
    they share the admin key it is derived from)."""
    return instance_tag(url, ADMIN_KEY)


def request(client: httpx.Client, gateway_url: str, key: str, *, stream: bool, prompt: str,
            ready: Any) -> Outcome:
    """One completion; its outcome (a 200 counts only if it completed with a finish_reason
    and no error event: an accepted request that broke is a failure)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream,
            "temperature": 0.0}

    def outcome(kind: str, engine: str = "", detail: str = "") -> Outcome:
        return Outcome(time.monotonic(), gateway_url, stream, kind, engine, detail, ready())

    try:
        with client.stream("POST", gateway_url + "/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status_code != 200:
                response.read()
                retryable = (response.status_code in (429, 503)
                             and "retry-after" in response.headers)
                return outcome("refused" if retryable else "failed",
                               detail=f"{response.status_code} {response.text[:300]}")
            engine = response.headers.get("x-loragate-instance", "")
            if not stream:
                response.read()
                choice = response.json()["choices"][0]
                if choice.get("finish_reason") is None:
                    return outcome("failed", engine, f"no finish_reason: {response.text}")
                return outcome("ok", engine)
            events: list[Any] = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
            finished = [e for e in events if isinstance(e, dict) and e.get("choices")
                        and e["choices"][0].get("finish_reason") is not None]
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            if errors and str(errors[-1]["error"].get("message", "")).startswith(
                    "the engine instance failed mid-response") and events[-1] == "[DONE]":
                return outcome("interrupted", engine, f"{events[-3:]!r}")
            if errors or not finished or events[-1] != "[DONE]":
                return outcome("failed", engine, f"stream broke: {events[-3:]!r}")
            return outcome("ok", engine)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return outcome("failed", detail=f"{type(exc).__name__}: {exc}")


def probe(cluster: Cluster, gateway: LiveServer, load: Load) -> set[str]:
    """A burst of concurrent requests to one gateway (counted with the load's); the engine
    URLs that served its 200s."""
    with httpx.Client(timeout=30.0) as client, \
            concurrent.futures.ThreadPoolExecutor(PROBE_BURST) as pool:
        outcomes = list(pool.map(lambda k: request(
            client, gateway.url, cluster.tenant_key, stream=k % 2 == 0,
            prompt=f"probe {k} {time.monotonic()}", ready=lambda: cluster.ready_engines),
            range(PROBE_BURST)))
    for o in outcomes:
        load.record(o)
    return {o.engine for o in outcomes if o.kind == "ok"}


def wait_routed_to(cluster: Cluster, load: Load, urls: set[str], what: str,
                   timeout_s: float = 20.0) -> None:
    """Every gateway sends traffic to each of urls (probe bursts until each was seen)."""
    tags = {tag(u) for u in urls}
    for gateway in cluster.gateways:
        seen: set[str] = set()
        started = time.monotonic()

        def covered(gw: LiveServer = gateway, seen: set[str] = seen) -> bool:
            seen |= probe(cluster, gw, load)
            return tags <= seen

        try:
            poll(covered, f"{gateway.url} to route to {what}", timeout_s, interval_s=0.1)
        except AssertionError as exc:
            recent = Counter((o.kind, o.engine) for o in load.since(started)
                             if o.gateway == gateway.url)
            raise AssertionError(f"{exc}: wanted {sorted(tags)} ({sorted(urls)}), saw "
                                 f"{sorted(seen)}; outcomes since: {dict(recent)}") from None
