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

The cluster is in tests/rehearsal_cluster.py, the client load in tests/rehearsal_load.py.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.live_http import poll
from tests.live_servers import LiveServer
from tests.redis_server import private_redis
from tests.rehearsal_cluster import ADMIN_KEY, Cluster, engine_idle
from tests.rehearsal_load import Load, request, tag, wait_routed_to

pytestmark = pytest.mark.slow


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
