"""A Redis password in --redis-url never reaches a tenant or a log: not through the 503s of
an outage (rate limiter with the closed policy, admin API), not through the gateway's log
while the store is down, not through the error of a gateway that cannot start."""

from __future__ import annotations

from pathlib import Path

import httpx

from gateway.serve import free_port
from tests.live_http import poll
from tests.live_servers import LiveServer, start_gateway
from tests.redis_server import private_redis

PASSWORD = "secretpw"
ADMIN = "test-admin-key"


def call(gateway: LiveServer, method: str, path: str, key: str,
         **kwargs: object) -> httpx.Response:
    return httpx.request(method, gateway.url + path, timeout=30.0,
                         headers={"Authorization": f"Bearer {key}"}, **kwargs)  # type: ignore[arg-type]


def _up(gateway: LiveServer) -> bool:
    if gateway.process.poll() is not None:
        raise AssertionError(f"gateway exited:\n{gateway.log()[-3000:]}")
    return call(gateway, "GET", "/admin/tenants", ADMIN).status_code == 200


def test_a_redis_outage_shows_tenants_and_logs_no_password(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    redis = private_redis(tmp_path, password=PASSWORD)
    # No engine is needed: the limiter and the admin API answer before any routing.
    gateway = start_gateway(tiny_model_dir, [f"http://127.0.0.1:{free_port()}"], tmp_path,
                            "--admin-key", ADMIN, "--redis-url", redis.url,
                            "--store-failure-policy", "closed", "--state-refresh-s", "0.1")
    try:
        poll(lambda: _up(gateway), "the gateway to serve its admin API", timeout_s=120)
        assert call(gateway, "POST", "/admin/tenants", ADMIN,
                    json={"tenant_id": "acme"}).status_code == 201
        key = call(gateway, "POST", "/admin/tenants/acme/keys", ADMIN).json()["key"]
        base = call(gateway, "GET", "/v1/models", key).json()["data"][0]["id"]
        redis.stop()
        responses = [
            call(gateway, "POST", "/v1/completions", key,
                 json={"model": base, "prompt": "hello", "max_tokens": 2}),
            call(gateway, "GET", "/admin/tenants", ADMIN),
            call(gateway, "POST", "/admin/tenants/acme/keys", ADMIN),
        ]
        for response in responses:
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "store_unavailable"
            assert PASSWORD not in response.text
            assert "redis" not in error["message"] and "127.0.0.1" not in error["message"]
        poll(lambda: "state store unavailable" in gateway.log(), "the outage to be logged")
    finally:
        gateway.stop()
        redis.stop()
    log = gateway.log()
    assert "redis://***@127.0.0.1" in log  # where it failed, without the secret
    assert PASSWORD not in log


def test_a_store_unreachable_at_startup_shows_no_password(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    gateway = start_gateway(tiny_model_dir, [f"http://127.0.0.1:{free_port()}"], tmp_path,
                            "--redis-url", url)
    try:
        code = gateway.process.wait(120)
    finally:
        gateway.kill()
    log = gateway.log()  # the process's stdout and stderr
    assert code != 0
    assert "redis://***@127.0.0.1" in log and "unreachable" in log
    assert PASSWORD not in log
