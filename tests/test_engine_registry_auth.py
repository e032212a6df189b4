"""The Redis engine registry only routes to engines that hold the engine token: whoever can
ZADD to it (a forged member, a replayed old one, an engine with another token) receives no
tenant's prompt. Live gateway and engines over a private real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis
import redis.asyncio as aioredis

from engine.http.registry import heartbeat, registry_client, signed_entry, verified_url
from gateway.exposure import instance_tag
from tests.live_http import instances, metric, poll
from tests.live_servers import start_engine, start_gateway
from tests.redis_server import private_redis

TOKEN = "registry-token-9d1e"
ENGINES_KEY = "lg:engines"  # gateway/redis_store.py's layout, default prefix


def test_entries_verify_only_with_the_token_and_before_their_expiry() -> None:
    now = time.time()
    entry = signed_entry(TOKEN, "http://10.0.0.1:8100", int(now) + 30)
    assert verified_url(TOKEN, entry, now) == "http://10.0.0.1:8100"
    assert verified_url("another-token", entry, now) is None
    assert verified_url(TOKEN, entry, now + 31) is None  # a replay after its expiry
    tampered = entry.replace("10.0.0.1", "10.6.6.6")
    assert verified_url(TOKEN, tampered, now) is None
    extended = entry.replace(f'"exp":{int(now) + 30}', f'"exp":{int(now) + 9999}')
    assert extended != entry and verified_url(TOKEN, extended, now) is None
    for junk in ("http://10.6.6.6:8100", "", "[]", "{}", '{"url": 1, "exp": 1, "sig": ""}',
                 entry.replace(f'"exp":{int(now) + 30}', f'"exp":{int(now) + 30}.5')):
        assert verified_url(TOKEN, junk, now) is None, junk


def _bad_signature(entry: str) -> str:
    fields = json.loads(entry)
    fields["sig"] = fields["sig"][:-1] + ("1" if fields["sig"][-1] == "0" else "0")
    return json.dumps(fields)


def test_forged_registry_entries_get_no_traffic(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = private_redis(tmp_path)
    # The attacker's server: a live engine that would happily take every prompt.
    attacker = start_engine(tiny_model_dir, tmp_path, "--num-kv-blocks", "64")
    engine = start_engine(tiny_model_dir, tmp_path, "--num-kv-blocks", "64",
                          "--register-redis-url", store.url, "--engine-token", TOKEN)
    gateway = None
    try:
        attacker.wait_ready()
        far = time.time() + 3600
        forged = {
            attacker.url: far,  # an unsigned member, as registrations used to be
            signed_entry("another-token", attacker.url, int(far)): far,
            signed_entry(TOKEN, attacker.url, int(time.time()) - 5): far,  # replayed, expired
            _bad_signature(signed_entry(TOKEN, attacker.url, int(far))): far,
        }
        redis.Redis.from_url(store.url).zadd(ENGINES_KEY, forged)
        engine.wait_ready()
        gateway = start_gateway(tiny_model_dir, [], tmp_path, "--instances", "0",
                                "--redis-url", store.url, "--engine-token", TOKEN,
                                "--served-model-name", "base")
        gateway.wait_ready()  # ready = it discovered a healthy engine in the registry
        assert list(instances(gateway.url)) == [engine.url]
        for _ in range(4):
            response = httpx.post(gateway.url + "/v1/completions", timeout=60.0,
                                  json={"model": "base", "prompt": "secret", "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert response.headers["x-loragate-instance"] == instance_tag(engine.url)
        poll(lambda: "ignoring 4 engine registry entries without a valid signature"
             in gateway.log(), "the warning about the forged entries")
        assert list(instances(gateway.url)) == [engine.url]
        assert gateway.log().count("without a valid signature") == 1  # rate limited
        # Not one prompt reached the attacker.
        metrics = httpx.get(attacker.url + "/metrics", timeout=10.0).text
        assert metric(metrics, "loragate_e2e_request_latency_seconds_count") == 0.0
    finally:
        for server in (gateway, engine, attacker):
            if server is not None:
                server.stop()
        store.stop()


def _serve(tiny_model_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LORAGATE_ENGINE_TOKEN"}
    # Refused at startup; the timeout only bounds a regression (a gateway serving forever).
    return subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--model",
                           str(tiny_model_dir), *flags], capture_output=True, text=True,
                          env=env, timeout=120)


def test_registry_discovery_without_a_token_refuses_to_start(tiny_model_dir: Path) -> None:
    result = _serve(tiny_model_dir, "--instances", "0", "--redis-url",
                    "redis://127.0.0.1:1/0", "--port", "1")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "loragate: error: discovering engines through the Redis registry needs --engine-token "
        "(the engines' token, which signs their registrations)")


def test_a_draining_engine_withdraws_its_registry_entries(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    store = private_redis(tmp_path)
    client = redis.Redis.from_url(store.url, decode_responses=True)
    engine = start_engine(tiny_model_dir, tmp_path, "--num-kv-blocks", "64",
                          "--register-redis-url", store.url, "--engine-token", TOKEN)
    try:
        engine.wait_ready()

        def urls() -> list[str | None]:
            members: list[str] = client.zrange(ENGINES_KEY, 0, -1)  # type: ignore[assignment]
            return [verified_url(TOKEN, m, time.time()) for m in members]

        poll(lambda: urls() == [engine.url] or None, "the engine's registration")
        engine.process.terminate()  # SIGTERM: drain, then exit
        # Gone well before its last beat's TTL (10 s) could have dropped it.
        poll(lambda: not client.zrange(ENGINES_KEY, 0, -1) or None,
             "the drained engine's entries withdrawn", timeout_s=3.0)
        assert engine.process.wait(30) == 0
    finally:
        engine.stop()
        store.stop()


def test_a_beat_whose_reply_timed_out_is_withdrawn_too(tmp_path: Path) -> None:
    # Under load the heartbeat's ZADD can land while its reply misses the client's 0.5 s
    # socket timeout. The drain must withdraw that member as well, or gateways keep
    # discovering a stopped engine until its TTL. A proxy in front of a real Redis holds
    # back the reply to a ZADD while `hold_zadd` is set; everything else passes at once.
    store = private_redis(tmp_path)
    hold_zadd = True

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", store.port)
        zadd_sent = asyncio.Event()

        async def requests() -> None:
            while data := await client_r.read(65536):
                if hold_zadd and b"ZADD" in data:
                    zadd_sent.set()
                server_w.write(data)
                await server_w.drain()
            server_w.close()

        async def replies() -> None:
            while data := await server_r.read(65536):
                if zadd_sent.is_set():
                    zadd_sent.clear()
                    await asyncio.sleep(1.0)
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        with contextlib.suppress(OSError):
            await asyncio.gather(requests(), replies())

    async def scenario() -> None:
        nonlocal hold_zadd
        proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
        port = proxy.sockets[0].getsockname()[1]
        direct = aioredis.from_url(store.url, decode_responses=True)
        draining = False
        beats = asyncio.create_task(heartbeat(
            registry_client(f"redis://127.0.0.1:{port}/0"), "http://e:1", TOKEN,
            ttl_s=30.0, draining=lambda: draining))
        await asyncio.sleep(1.5)  # the first beat timed out (logged) after its write landed
        assert await direct.zcard(ENGINES_KEY) == 1
        hold_zadd, draining = False, True
        await asyncio.wait_for(beats, 10)
        assert await direct.zrange(ENGINES_KEY, 0, -1) == []  # not left for its 30 s TTL
        await direct.aclose()
        proxy.close()

    try:
        asyncio.run(scenario())
    finally:
        store.stop()
