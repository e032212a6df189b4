"""The scale rehearsal's cluster (tests/test_scale_rehearsal_live.py): engines and gateways as
separate processes configured as deploy/kustomize configures the pods (secrets and registry
URLs in the environment, knobs as LORAGATE_<FIELD> variables, engines announcing themselves
in the signed Redis registry, gateways `serve --instances 0`), and what the registry, each
gateway and each engine say about them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from engine.http.registry import verified_url
from gateway.serve import free_port
from tests.live_http import instances
from tests.live_servers import LiveServer
from tests.redis_server import PrivateRedis

ENGINE_TOKEN = "rehearsal-engine-token-4f1c"
ADMIN_KEY = "rehearsal-admin-key-77b2"
MODEL = "tiny"
REGISTRY_KEY = "lg:engines"  # engine/http/registry.py: DEFAULT_PREFIX + REGISTRY_KEY

# Engine knobs as the loragate-engine-knobs ConfigMap gives them (small: 2 shared cores).
ENGINE_KNOBS = {"LORAGATE_NUM_KV_BLOCKS": "256", "LORAGATE_MAX_NUM_SEQS": "4",
                "LORAGATE_PREFIX_CACHING": "on", "LORAGATE_SCHEDULING_POLICY": "priority"}
# Gateway knobs as the loragate-gateway-config ConfigMap gives them; poll fast so that
# ejection and discovery take fractions of a second, not the production defaults.
GATEWAY_KNOBS = {"LORAGATE_DRAIN_TIMEOUT_S": "30", "LORAGATE_STORE_FAILURE_POLICY": "open",
                 "LORAGATE_ROUTING": "score", "LORAGATE_POLL_INTERVAL_S": "0.2",
                 "LORAGATE_SERVED_MODEL_NAME": MODEL}
# No debug headers: as in the pods, responses name their engine only by the opaque
# x-loragate-instance tag (see tests/rehearsal_load.py: tag()).


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


def engine_idle(url: str) -> bool:
    response = httpx.get(url + "/state", timeout=5.0,
                         headers={"Authorization": f"Bearer {ENGINE_TOKEN}"})
    response.raise_for_status()
    s = response.json()
    return (s["num_running"], s["num_waiting"], s["num_swapped"], s["kv_blocks_used"]) == (
        0, 0, 0, 0)
