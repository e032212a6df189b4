"""A tenant's rate-limit claims end with every request, however it ends: a bad request never
leaks a concurrency slot (which would lock the tenant out), and every request refused after
admission (a bad body, too long, unknown model) still counts against its RPM, because
admission comes before the body is even parsed. Live engine + gateway (tiny model,
1024-token context) with tenants created through the admin API.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.live_http import poll, wait_engines_idle
from tests.live_servers import LiveServer, running, start_engine, start_gateway

ADMIN = "edge-admin-key"
CONTEXT = 1024
# A full 16-token block: the gateway hashes full blocks for prefix routing (uint32 tokens).
BLOCK_WITH_A_HUGE_ID = [5] * 15 + [2**32]


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[LiveServer, LiveServer]]:
    root = tmp_path_factory.mktemp("claims")
    # One request runs at a time: a second one waits, accepted, for its first token.
    engine = start_engine(tiny_model_dir, root, "--num-kv-blocks", "128", "--max-num-seqs", "1")
    gateway = start_gateway(tiny_model_dir, [engine.url], root, "--admin-key", ADMIN,
                            "--state-refresh-s", "0.1")
    with running(engine, gateway):
        yield engine, gateway


def _admin(gateway: LiveServer, path: str, body: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    response = httpx.post(gateway.url + path, json=body, timeout=30.0,
                          headers={"Authorization": f"Bearer {ADMIN}"})
    assert response.status_code == 201, response.text
    return dict(response.json())


def _tenant(gateway: LiveServer, tenant_id: str, **limits: int) -> str:
    """A new tenant's key, once the gateway accepts it."""
    _admin(gateway, "/admin/tenants", {"tenant_id": tenant_id, **limits})
    key = str(_admin(gateway, f"/admin/tenants/{tenant_id}/keys")["key"])
    poll(functools.partial(_known, gateway, key), f"the gateway to know {tenant_id}'s key")
    return key


def _known(gateway: LiveServer, key: str) -> bool:
    return httpx.get(gateway.url + "/v1/models", timeout=10.0,
                     headers={"Authorization": f"Bearer {key}"}).status_code == 200


def _model(gateway: LiveServer) -> str:
    return str(httpx.get(gateway.url + "/v1/models", timeout=10.0,
                         headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"][0]["id"])


def _post(gateway: LiveServer, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    """json.dumps escapes a lone surrogate as \\ud800 (httpx's own encoder cannot send it)."""
    return httpx.post(gateway.url + path, content=json.dumps(body), timeout=60.0,
                      headers={"Authorization": f"Bearer {key}",
                               "content-type": "application/json"})


def _fresh_window() -> None:
    """Limits count per clock minute: start with at least 10 s of the minute left, so the
    requests the test counts cannot straddle two windows."""
    left = 60 - time.time() % 60
    if left < 10:
        time.sleep(left + 0.1)


def test_bad_requests_release_their_slot_and_count_against_rpm(
        servers: tuple[LiveServer, LiveServer]) -> None:
    engine, gateway = servers
    model = _model(gateway)
    completion = {"model": model, "prompt": "hello", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    bad: list[tuple[str, dict[str, Any], int]] = [
        ("/v1/completions", {**completion, "prompt": BLOCK_WITH_A_HUGE_ID}, 400),
        ("/v1/completions", {**completion, "prompt": "\ud800"}, 400),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "\ud800"}]},
         400),
        ("/v1/completions", {**completion, "temperature": 5}, 400),
        ("/v1/completions", {**completion, "prompt": "x" * 40_000}, 400),
        ("/v1/completions", {**completion, "prompt": [7] * CONTEXT}, 400),
        ("/v1/chat/completions", {**chat, "max_tokens": CONTEXT + 1}, 400),
        ("/v1/completions", {**completion, "model": "nope"}, 404),
    ]
    _fresh_window()
    key = _tenant(gateway, "solo", max_concurrency=1, rpm=len(bad) + 2)
    statuses = [_post(gateway, key, path, body).status_code for path, body, _ in bad]
    assert statuses == [status for *_, status in bad]
    # One slot, never leaked: both good requests pass; then the RPM the bad ones used is gone.
    good = [_post(gateway, key, "/v1/completions", completion) for _ in range(3)]
    assert [r.status_code for r in good] == [200, 200, 429], good[-1].text
    assert good[-1].json()["error"]["code"] == "rpm_exceeded"
    wait_engines_idle(engine.url)


def test_a_key_over_its_limit_is_refused_before_its_body_is_parsed(
        servers: tuple[LiveServer, LiveServer]) -> None:
    """A flood of large invalid bodies cannot cost the gateway their parsing once its key is
    over its RPM: the 429 comes before the body, whatever the body."""
    _, gateway = servers
    _fresh_window()
    key = _tenant(gateway, "flooder", rpm=1)
    assert _post(gateway, key, "/v1/completions", {"temperature": 5}).status_code == 400
    refused = httpx.post(gateway.url + "/v1/chat/completions", content=b"{not json" * 10_000,
                         timeout=60.0, headers={"Authorization": f"Bearer {key}",
                                                "content-type": "application/json"})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rpm_exceeded"


def test_too_many_message_parts_are_refused_before_any_is_validated(
        servers: tuple[LiveServer, LiveServer]) -> None:
    _, gateway = servers
    part = {"type": "text", "text": ""}
    messages = [{"role": "user", "content": [part] * 60}] * 4096  # 7.5 MB of empty parts
    response = _post(gateway, ADMIN, "/v1/chat/completions",
                     {"model": _model(gateway), "messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "245760 content parts and tool calls in all, more than 8192" in error["message"]


def test_a_stream_left_before_its_first_token_is_charged_its_prompt(
        servers: tuple[LiveServer, LiveServer]) -> None:
    """Its prompt was taken by the engine (and would have been prefilled): TPM charges it,
    so a client cannot have prompts computed for free by leaving once the headers come."""
    engine, gateway = servers
    model = _model(gateway)
    _fresh_window()
    key = _tenant(gateway, "leaver", tpm=1500)
    prompt = [7] * 600
    with httpx.stream("POST", gateway.url + "/v1/completions", timeout=60.0, json={
            "model": model, "prompt": [5] * 8, "max_tokens": 400, "ignore_eos": True,
            "stream": True}, headers={"Authorization": f"Bearer {ADMIN}"}) as busy:
        assert busy.status_code == 200  # holds the engine's only running seat
        next(busy.iter_lines())
        with httpx.stream("POST", gateway.url + "/v1/completions", timeout=60.0, json={
                "model": model, "prompt": prompt, "max_tokens": 4, "stream": True},
                headers={"Authorization": f"Bearer {key}"}) as left:
            assert left.status_code == 200  # accepted, waiting: the client leaves now
    wait_engines_idle(engine.url)  # the left stream was aborted: its claim is settled
    time.sleep(0.5)  # and the charge recorded (the limiter's release runs in the background)
    # 600 charged of 1500: a request needing 1000 more no longer fits this minute.
    refused = _post(gateway, key, "/v1/completions", {"model": model, "prompt": prompt,
                                                       "max_tokens": 400})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "tpm_exceeded"
