"""A multi-node rehearsal on one machine: 2 gateways + 3 engines + a private Redis, each a
separate process on its own port, configured as deploy/kustomize configures the pods
(secrets and registry URLs in the environment, knobs as LORAGATE_<FIELD> variables, engines
announcing themselves in the signed Redis registry, gateways `serve --instances 0`).

Under a client load that never stops (threads sending small completions, streamed and not,
alternately to both gateways), it proves that:

1. both gateways discover all 3 engines through the registry and route to each of them;
2. an engine killed with SIGKILL is ejected by both gateways and no accepted request is
   lost: requests not yet started on it, and whole (not streamed) responses it was in the
   middle of, start over elsewhere; only a stream that had already sent the client tokens
   from it ends with the "failed mid-response" error event (its tokens cannot be taken
   back); the same engine restarted on the same port is routed to again;
3. scaling 3 -> 1 with SIGTERM drains (in-flight streams finish, the engines exit 0, their
   registry entries expire and the gateways forget them, traffic goes on on the survivor
   only), and scaling 1 -> 3 with new engines converges (both gateways see 3 healthy
   instances and send traffic to each);
4. at the end every request is accounted for: each ended in a complete 200 (a
   finish_reason, no error event) or, only while no engine was ready, a 503/429 with
   Retry-After; none failed; every engine is idle (no KV block in use) and every process
   stops cleanly.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from engine.http.registry import verified_url
from gateway.exposure import instance_tag
from gateway.serve import free_port
from tests.live_http import instances, poll
from tests.live_servers import LiveServer
from tests.redis_server import PrivateRedis, private_redis

pytestmark = pytest.mark.slow

ENGINE_TOKEN = "rehearsal-engine-token-4f1c"
ADMIN_KEY = "rehearsal-admin-key-77b2"
MODEL = "tiny"
REGISTRY_KEY = "lg:engines"  # engine/http/registry.py: DEFAULT_PREFIX + REGISTRY_KEY
CLIENT_THREADS = 3
THINK_S = 0.05
"""Pause between one thread's requests: the load must leave CPU for engines to start (an
engine loads in ~5 s alone on 2 cores, ~30 s under a saturating load)."""
MAX_TOKENS = 8
PROBE_BURST = 5
"""Concurrent requests per probe: the router spreads a burst by in-flight load, so a burst
reaches every healthy engine (one request at a time would follow the score's tie-break)."""

# Engine knobs as the loragate-engine-knobs ConfigMap gives them (small: 2 shared cores).
ENGINE_KNOBS = {"LORAGATE_NUM_KV_BLOCKS": "256", "LORAGATE_MAX_NUM_SEQS": "4",
                "LORAGATE_PREFIX_CACHING": "on", "LORAGATE_SCHEDULING_POLICY": "priority"}
# Gateway knobs as the loragate-gateway-config ConfigMap gives them; poll fast so that
# ejection and discovery take fractions of a second, not the production defaults.
GATEWAY_KNOBS = {"LORAGATE_DRAIN_TIMEOUT_S": "30", "LORAGATE_STORE_FAILURE_POLICY": "open",
                 "LORAGATE_ROUTING": "score", "LORAGATE_POLL_INTERVAL_S": "0.2",
                 "LORAGATE_SERVED_MODEL_NAME": MODEL}
# No debug headers: as in the pods, responses name their engine only by the opaque
# x-loragate-instance tag (see tag()).


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    # Nothing inherited may override the pod-like configuration (a developer's shell could
    # export LORAGATE_* knobs or a token).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LORAGATE_") or k in ("LORAGATE_STATE_PATH",
                                                      "LORAGATE_DEMO_ADAPTERS")}
    return {**env, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def _spawn(module: list[str], env: dict[str, str], log_path: Path, port: int) -> LiveServer:
    with open(log_path, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", *module], stdout=out,
                                   stderr=subprocess.STDOUT, env=_child_env(env))
    return LiveServer(f"http://127.0.0.1:{port}", process, log_path, module)


@dataclass
class Cluster:
    model_dir: Path
    logs: Path
    store: PrivateRedis
    engines: dict[str, LiveServer] = field(default_factory=dict)
    """Engines by name (the StatefulSet's pod names), running or not."""
    gateways: list[LiveServer] = field(default_factory=list)
    stopped: list[LiveServer] = field(default_factory=list)
    """Every process this cluster ever started (for the final cleanup and log dumps)."""
    ready_engines: int = 0
    """How many engines the scenario has running and ready (never 0 here: the rehearsal
    keeps one engine at least, so a refusal is never excused)."""
    lives: Counter[str] = field(default_factory=Counter)
    tenant_key: str = ""
    """A tenant's API key (created through one gateway's admin API; both share it via
    Redis), sent by every client request."""

    def start_engine(self, name: str, port: int | None = None) -> LiveServer:
        port = port or free_port()
        self.lives[name] += 1
        env = {"LORAGATE_ENGINE_TOKEN": ENGINE_TOKEN,
               "LORAGATE_REGISTER_REDIS_URL": self.store.url,
               # The pod IP in a cluster; loopback here.
               "LORAGATE_ADVERTISE_URL": f"http://127.0.0.1:{port}", **ENGINE_KNOBS}
        server = _spawn(["engine.http", "--model", str(self.model_dir), "--host",
                         "127.0.0.1", "--port", str(port), "--instance-id", name], env,
                        self.logs / f"{name}-life{self.lives[name]}-{port}.log", port)
        self.engines[name] = server
        self.stopped.append(server)
        return server

    def start_gateway(self) -> LiveServer:
        port = free_port()
        env = {"LORAGATE_REDIS_URL": self.store.url, "LORAGATE_ADMIN_KEY": ADMIN_KEY,
               "LORAGATE_ENGINE_TOKEN": ENGINE_TOKEN, **GATEWAY_KNOBS}
        server = _spawn(["gateway.cli", "serve", "--model", str(self.model_dir),
                         "--instances", "0", "--host", "127.0.0.1", "--port", str(port)],
                        env, self.logs / f"gateway-{port}.log", port)
        self.gateways.append(server)
        self.stopped.append(server)
        return server

    def registered(self) -> set[str]:
        """Engine URLs with a verified, unexpired entry in the registry."""
        client = redis.Redis.from_url(self.store.url, decode_responses=True)
        now = time.time()
        members: list[str] = client.zrangebyscore(REGISTRY_KEY, now, "+inf")  # type: ignore[assignment]
        return {url for m in members if (url := verified_url(ENGINE_TOKEN, m, now))}

    def healthy_views(self) -> list[set[str]]:
        """Per gateway: the engine URLs its /instances shows healthy."""
        return [{url for url, i in instances(gw.url, ADMIN_KEY).items() if i["healthy"]}
                for gw in self.gateways]

    def known_views(self) -> list[set[str]]:
        """Per gateway: every engine URL in its pool (healthy or not)."""
        return [set(instances(gw.url, ADMIN_KEY)) for gw in self.gateways]

    def logs_tail(self, chars: int = 2500) -> str:
        return "\n".join(f"==== {s.log_path.name}\n{s.log()[-chars:]}" for s in self.stopped)


# ------------------------------------------------------------------------- the client load
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


def engine_idle(url: str) -> bool:
    response = httpx.get(url + "/state", timeout=5.0,
                         headers={"Authorization": f"Bearer {ENGINE_TOKEN}"})
    response.raise_for_status()
    s = response.json()
    return (s["num_running"], s["num_waiting"], s["num_swapped"], s["kv_blocks_used"]) == (
        0, 0, 0, 0)


# ------------------------------------------------------------------------------ the test
@pytest.fixture
def cluster(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Cluster]:
    # A private redis-server: the registry key (lg:engines) is fixed in engine/http/
    # registry.py, so on the shared Redis other tests' engines would join this cluster.
    store = private_redis(tmp_path)
    cluster = Cluster(tiny_model_dir, tmp_path, store)
    try:
        yield cluster
    finally:
        for server in reversed(cluster.stopped):
            server.stop(timeout_s=10)
        store.stop()


def test_scale_rehearsal(cluster: Cluster) -> None:
    started = time.monotonic()
    try:
        _rehearse(cluster)
    except BaseException:
        print(f"rehearsal failed after {time.monotonic() - started:.1f}s; logs in "
              f"{cluster.logs}\n{cluster.logs_tail()}")
        raise
    print(f"rehearsal took {time.monotonic() - started:.1f}s")


def _rehearse(cluster: Cluster) -> None:
    # ---- 1. three engines register, both gateways discover and route to all of them.
    engines = [cluster.start_engine(f"loragate-engine-{k}") for k in range(3)]
    gateways = [cluster.start_gateway() for _ in range(2)]
    for server in engines:
        server.wait_ready()
    cluster.ready_engines = 3
    for server in gateways:
        server.wait_ready()  # ready: it found a healthy engine in the registry
    urls = {e.url for e in engines}
    poll(lambda: cluster.registered() == urls, "the 3 engines in the registry", 15)
    poll(lambda: all(v == urls for v in cluster.healthy_views()),
         "both gateways to see the 3 engines healthy", 15)
    # A tenant made through gateway 0; its key must work on gateway 1 too (shared Redis).
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    created = httpx.post(gateways[0].url + "/admin/tenants", json={"tenant_id": "rehearsal"},
                         headers=admin, timeout=10.0)
    assert created.status_code == 201, created.text
    issued = httpx.post(gateways[0].url + "/admin/tenants/rehearsal/keys", headers=admin,
                        timeout=10.0)
    assert issued.status_code == 201, issued.text
    cluster.tenant_key = str(issued.json()["key"])
    with httpx.Client(timeout=30.0) as client:
        for gateway in gateways:
            def accepted(gw: LiveServer = gateway) -> bool:
                return request(client, gw.url, cluster.tenant_key, stream=False,
                               prompt="hello", ready=lambda: 3).kind == "ok"

            poll(accepted, f"the tenant key to work on {gateway.url}", 15, interval_s=0.2)
    load = Load(cluster)
    load.start()
    wait_routed_to(cluster, load, urls, "all 3 engines")

    # ---- 2. SIGKILL one engine mid-load: ejected, nothing accepted is lost; then it comes
    # back on the same port and is routed to again.
    victim = engines[0]
    poll(lambda: len(load.since(time.monotonic() - 1.0)) >= 4, "the load to be flowing", 15)
    cluster.ready_engines = 2  # before the kill: outcomes recorded from now see 2 ready
    victim.kill()
    killed_at = time.monotonic()
    # Restarted at once, as the kubelet restarts a crashed container; it takes seconds to
    # load, so the ejection below is checked while it is still down.
    restarted = cluster.start_engine("loragate-engine-0", port=int(victim.url.rsplit(":", 1)[1]))
    poll(lambda: all(victim.url not in v for v in cluster.healthy_views()),
         "both gateways to eject the killed engine", 10)
    # Traffic goes on: fresh requests complete on the other two.
    poll(lambda: sum(o.kind == "ok" for o in load.since(time.monotonic() - 0.5)) >= 2,
         "requests completing after the kill", 10)
    assert restarted.process.poll() is None
    restarted.wait_ready()
    cluster.ready_engines = 3
    poll(lambda: all(v == urls for v in cluster.healthy_views()),
         "both gateways to take the restarted engine back", 15)
    wait_routed_to(cluster, load, urls, "the restarted engine and the others")
    engines[0] = restarted
    print(f"kill -> back in rotation: {time.monotonic() - killed_at:.1f}s")

    # ---- 3a. scale 3 -> 1: SIGTERM two engines at once; they withdraw their registry
    # entries, drain and exit 0, the gateways forget them, traffic stays on the survivor.
    survivor, leaving = engines[0], engines[1:]
    for server in leaving:
        server.process.terminate()
    for server in leaving:
        assert server.process.wait(45) == 0, server.log()[-3000:]
    cluster.ready_engines = 1
    gone_at = time.monotonic()
    left = {s.url for s in leaving}
    # Withdrawn when their drain began, not left to expire (the heartbeat TTL is 10 s).
    assert not (cluster.registered() & left)
    # ---- 3b (started now). scale 1 -> 3: two new engines (new pods: new addresses), as
    # `kubectl scale` right after a scale-down would.
    newcomers = [cluster.start_engine(f"loragate-engine-{k}") for k in (1, 2)]
    poll(lambda: all(not (v & left) for v in cluster.known_views()),
         "both gateways to forget the drained engines", 10)
    # Traffic goes on, on the survivor alone while the newcomers load (the entries went at
    # once, so nothing else gives the load time to reach it: wait for it).
    def on_survivor() -> int:
        return sum(o.kind == "ok" and o.engine == tag(survivor.url)
                   for o in load.since(gone_at))

    poll(lambda: on_survivor() >= 3 or None, "traffic on the survivor alone", 15)

    for server in newcomers:
        server.wait_ready()
    cluster.ready_engines = 3
    scaled_at = time.monotonic()
    urls = {survivor.url} | {s.url for s in newcomers}
    poll(lambda: all(v == urls for v in cluster.healthy_views()),
         "both gateways to see 3 healthy engines again", 10)
    wait_routed_to(cluster, load, urls, "the 3 engines after scaling up", 10)
    print(f"scale-up converged in {time.monotonic() - scaled_at:.1f}s")
    # Not one request went to a drained engine after it had exited.
    misrouted = [o for o in load.since(gone_at) if o.engine in {tag(u) for u in left}]
    assert not misrouted, f"routed to a drained engine: {misrouted[:5]}"

    # ---- 4. accounting, idle engines, clean stops.
    load.stop()
    outcomes = load.since(0.0)
    kinds = Counter(o.kind for o in outcomes)
    names = {tag(s.url): f"{Path(s.log_path).stem}" for s in cluster.stopped}
    print(f"requests: {len(outcomes)} {dict(kinds)}; per engine: "
          f"{dict(Counter(names.get(o.engine, o.engine) for o in outcomes if o.kind == 'ok'))}")
    failed = [o for o in outcomes if o.kind == "failed"]
    evidence = "\n".join(line for gw in cluster.gateways for line in gw.log().splitlines()
                         if "mid-response" in line or "failed:" in line)
    assert not failed, f"{len(failed)} request(s) failed: {failed[:5]}\n{evidence}"
    # The rehearsal always keeps an engine ready, so no refusal is excused.
    unexcused = [o for o in outcomes if o.kind == "refused" and o.ready_engines > 0]
    assert not unexcused, f"{len(unexcused)} refusal(s) while engines were ready: " \
        f"{unexcused[:5]}"
    # Only streams the killed engine had started may have been cut, with the error event.
    interrupted = [o for o in outcomes if o.kind == "interrupted"]
    assert all(o.stream and o.engine == tag(victim.url) for o in interrupted), interrupted
    assert kinds["ok"] + len(interrupted) == len(outcomes)
    for url in sorted(urls):
        poll(functools.partial(engine_idle, url), f"{url} to be idle (no KV blocks in use)",
             10)
    for server in cluster.gateways:
        assert server.stop(45) == 0, server.log()[-3000:]
    for server in [survivor, *newcomers]:
        assert server.stop(45) == 0, server.log()[-3000:]
