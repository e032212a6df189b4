"""Helpers of the tenancy tests (tests/tenancy/): the live setup's parts and the
admin and client calls they make."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from tests.live_http import metric
from tests.live_servers import LiveServer
from tests.redis_server import PrivateRedis

ADMIN = "test-admin-key"


@dataclass
class Setup:
    engine: LiveServer
    gateways: list[LiveServer]
    redis: PrivateRedis
    adapters: dict[str, Path]
    upload_dir: Path
    other_model: Path


def admin(setup: Setup, method: str, path: str, gateway: int = 0,
          **kwargs: object) -> httpx.Response:
    return httpx.request(method, setup.gateways[gateway].url + path, timeout=30.0,
                         headers={"Authorization": f"Bearer {ADMIN}"}, **kwargs)  # type: ignore[arg-type]


def new_tenant(setup: Setup, tenant_id: str, **limits: object) -> str:
    """Create a tenant and return a fresh key."""
    assert admin(setup, "POST", "/admin/tenants",
                 json={"tenant_id": tenant_id, **limits}).status_code == 201
    response = admin(setup, "POST", f"/admin/tenants/{tenant_id}/keys")
    assert response.status_code == 201
    return str(response.json()["key"])


def complete(setup: Setup, key: str, model: str, prompt: list[int] | str = "hello",
             gateway: int = 0, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(setup.gateways[gateway].url + "/v1/completions", timeout=60.0,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True})


def sees_adapter(setup: Setup, key: str, gateway: int, adapter: str) -> bool:
    return adapter in models(setup, key, gateway)


def if_status(response: httpx.Response, status: int) -> httpx.Response | None:
    return response if response.status_code == status else None


def models(setup: Setup, key: str, gateway: int = 0) -> list[str]:
    """The model ids the key may use on that replica ([] while the replica rejects it)."""
    response = httpx.get(setup.gateways[gateway].url + "/v1/models",
                         headers={"Authorization": f"Bearer {key}"}, timeout=10.0)
    if response.status_code == 401:
        return []
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


def engine_holds(setup: Setup, name: str) -> bool:
    """Whether the engine has an adapter of that name registered."""
    held = httpx.get(setup.engine.url + "/adapters", timeout=10.0).json()
    return any(a["name"] == name for a in held)


def engine_hits(setup: Setup) -> float:
    text = httpx.get(setup.engine.url + "/metrics", timeout=10.0).text
    return metric(text, "loragate_prefix_cache_hit_tokens_total")


def answer_to_headers(url: str, path: str, key: str, announced: int) -> bytes:
    """What the gateway answers a POST whose headers announce ``announced`` bytes of body
    while only one is sent, read until it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30.0) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                     f"application/json\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Length: {announced}\r\n\r\n{{".encode())
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def tokens_counted(setup: Setup, tenant: str) -> int:
    """The tenant's tokens in its TPM window, as the shared Redis holds them (counted per
    incarnation: under its id and uid)."""
    uid = admin(setup, "GET", f"/admin/tenants/{tenant}").json()["uid"]
    counter = redis.Redis.from_url(setup.redis.url)
    return sum(int(v) for v in counter.hvals(f"lg:rl:{tenant}:{uid}:tok"))


def below(value: int, limit: int) -> int | None:
    return value if value < limit else None
