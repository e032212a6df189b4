"""Tenancy end to end (tests/tenancy/conftest.py's setup): RPM/TPM exact across two gateway
replicas, tokenizer calls counted, a Redis outage served by the fail-open policy, the admin
API's adapter uploads (refused cleanly, lazy load, status), engines found through the
registry, and the OpenAPI schema of the admin API."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine.demo_model import make_peft_adapter
from gateway.exposure import instance_tag
from gateway.sliding_window import WINDOW_S
from tests.adapter_lifecycle_helpers import tar_dir
from tests.live_http import metric, poll, wait_engines_idle
from tests.live_servers import start_engine, start_gateway
from tests.tenancy_helpers import (
    ADMIN,
    Setup,
    admin,
    answer_to_headers,
    below,
    complete,
    if_status,
    models,
    new_tenant,
    tokens_counted,
)


# ---------------------------------------------------------------------------- rate limits
def test_rpm_is_exact_across_two_gateways(setup: Setup) -> None:
    key = new_tenant(setup, "delta", rpm=4)
    base = poll(lambda: models(setup, key, 1), "replica 1 to know delta")[0]
    statuses = [complete(setup, key, base, gateway=i % 2) for i in range(6)]
    assert [r.status_code for r in statuses].count(200) == 4
    # OpenAI's headers, counted across both replicas (Redis): 3, 2, 1, 0 requests left.
    assert sorted(r.headers["x-ratelimit-remaining-requests"] for r in statuses
                  if r.status_code == 200) == ["0", "1", "2", "3"]
    assert {r.headers["x-ratelimit-limit-requests"] for r in statuses} == {"4"}
    assert all("x-ratelimit-limit-tokens" not in r.headers for r in statuses)  # no tpm
    limited = [r for r in statuses if r.status_code == 429]
    assert len(limited) == 2
    for response in limited:
        assert 1 <= int(response.headers["retry-after"]) <= WINDOW_S  # 61 s said as 60
        assert response.json()["error"]["code"] == "rpm_exceeded"
        assert "rpm" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/detokenize",
                                  "/admin/adapters"])
def test_an_unknown_key_is_refused_before_the_body_is_read(setup: Setup, path: str) -> None:
    """An anonymous client must not make the gateway read and parse megabytes of JSON: the
    401 comes while the announced body has not even been sent."""
    answer = answer_to_headers(setup.gateways[0].url, path, "nope", 4 << 20)
    assert answer.startswith(b"HTTP/1.1 401"), answer
    assert b"invalid_api_key" in answer


def test_tokenizer_calls_count_against_rpm(setup: Setup) -> None:
    """/tokenize and /detokenize are CPU work on the gateway: a tenant over its RPM is
    refused there too (and they count, charged no tokens)."""
    key = new_tenant(setup, "eta", rpm=3)
    base = poll(lambda: models(setup, key, 0), "the gateway to know eta")[0]
    url, auth = setup.gateways[0].url, {"Authorization": f"Bearer {key}"}
    assert httpx.post(url + "/tokenize", headers=auth, timeout=30.0,
                      json={"model": base, "prompt": "hello"}).status_code == 200
    assert httpx.post(url + "/detokenize", headers=auth, timeout=30.0,
                      json={"model": base, "tokens": [20, 21]}).status_code == 200
    assert complete(setup, key, base).status_code == 200
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [20]})):
        refused = httpx.post(url + path, headers=auth, timeout=30.0, json={"model": base, **body})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rpm_exceeded"


def test_an_abandoned_whole_response_is_charged_what_the_engine_generated(
        setup: Setup) -> None:
    """A non-streamed request's tokens wait at the gateway until the last: a client that
    leaves before then is still charged the prompt and what the engine generated."""
    key = new_tenant(setup, "theta", tpm=100_000)
    base = poll(lambda: models(setup, key, 0), "the gateway to know theta")[0]
    with pytest.raises(httpx.ReadTimeout):  # 1000 tokens take the tiny engine seconds
        httpx.post(setup.gateways[0].url + "/v1/completions",
                   headers={"Authorization": f"Bearer {key}"},
                   timeout=httpx.Timeout(30.0, read=0.6),
                   json={"model": base, "prompt": "hello", "max_tokens": 1000,
                         "temperature": 0, "ignore_eos": True})
    tokens = poll(lambda: below(tokens_counted(setup, "theta"), 1000),  # once settled
                  "the abandoned request to be settled")
    assert 10 < tokens < 1000  # the prompt and what was generated in 0.6 s, not nothing


def test_tpm_counts_prompt_and_completion_tokens(setup: Setup) -> None:
    key = new_tenant(setup, "epsilon", tpm=50)
    base = poll(lambda: models(setup, key, 1), "replica 1 to know epsilon")[0]
    first = complete(setup, key, base, list(range(10, 50)), max_tokens=8)  # 48 tokens
    assert first.status_code == 200
    assert (first.headers["x-ratelimit-limit-tokens"],
            first.headers["x-ratelimit-remaining-tokens"]) == ("50", "2")  # 48 reserved
    assert first.json()["usage"]["total_tokens"] == 48
    refused = poll(lambda: if_status(complete(setup, key, base, gateway=1), 429),
                   "the charge to reach the shared counter", timeout_s=5)
    assert refused.json()["error"]["code"] == "tpm_exceeded"


def test_samples_of_one_prompt_reserve_the_prompt_once(setup: Setup) -> None:
    # n=3 of a 40-token prompt, 8 tokens each: 40 + 24 reserved (as usage counts them), not
    # 3 x 40 + 24, which a TPM of 100 would refuse as never fitting.
    key = new_tenant(setup, "kappa", tpm=100)
    base = poll(lambda: models(setup, key, 0), "the gateway to know kappa")[0]
    reply = httpx.post(setup.gateways[0].url + "/v1/completions", timeout=60.0,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"model": base, "prompt": list(range(10, 50)), "max_tokens": 8,
                             "n": 3, "temperature": 1.0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-ratelimit-remaining-tokens"] == "36"
    assert reply.json()["usage"]["total_tokens"] == 64


def test_a_chat_without_max_tokens_reserves_a_share_not_the_whole_context(
        setup: Setup) -> None:
    # Its output may fill the context (1024 tokens here): reserving all of that would
    # refuse it outright under a TPM of 400; it reserves UNSET_RESERVE and is charged what
    # it used.
    key = new_tenant(setup, "iota", tpm=400)
    base = poll(lambda: models(setup, key, 0), "the gateway to know iota")[0]
    reply = httpx.post(setup.gateways[0].url + "/v1/chat/completions", timeout=60.0,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"model": base, "messages": [{"role": "user", "content": "hi"}],
                             "temperature": 0})
    assert reply.status_code == 200, reply.text
    used = reply.json()["usage"]["total_tokens"]
    assert poll(lambda: tokens_counted(setup, "iota") == used or None,
                "the request to be charged what it used")
    # Under a TPM below prompt + UNSET_RESERVE the reserve shrinks to what the limit leaves
    # beside the prompt: served, not refused as never fitting.
    small = new_tenant(setup, "iota-small", tpm=reply.json()["usage"]["prompt_tokens"] + 8)
    poll(lambda: models(setup, small, 0), "the gateway to know iota-small")
    served = httpx.post(setup.gateways[0].url + "/v1/chat/completions", timeout=60.0,
                        headers={"Authorization": f"Bearer {small}"},
                        json={"model": base, "messages": [{"role": "user", "content": "hi"}],
                              "temperature": 0})
    assert served.status_code == 200, served.text


def test_redis_outage_fails_open_and_recovers(setup: Setup) -> None:
    key = new_tenant(setup, "zeta", rpm=1000)
    base = poll(lambda: models(setup, key, 1), "replica 1 to know zeta")[0]
    setup.redis.stop()
    try:
        for gateway in (0, 1):
            assert complete(setup, key, base, gateway=gateway).status_code == 200
        text = admin(setup, "GET", "/metrics").text
        assert metric(text, "loragate_gateway_store_unavailable_total", policy="open") >= 1
        down = admin(setup, "GET", "/admin/tenants")
        assert down.status_code == 503
        assert down.json()["error"]["code"] == "store_unavailable"
    finally:
        setup.redis.start()
    # Back without restarting the gateways: the admin API and shared limits work again.
    poll(lambda: admin(setup, "GET", "/admin/tenants").status_code == 200,
         "the admin API to reach Redis again")
    assert complete(setup, key, base, gateway=1).status_code == 200


# ---------------------------------------------------------------------------------- admin
def test_bad_uploads_are_refused_and_leave_nothing(setup: Setup, tenants: dict[str, str],
                                                   tmp_path: Path) -> None:
    """Refused for their content, not their owner: alpha exists (the tenants fixture)."""
    mismatched = make_peft_adapter(setup.other_model, tmp_path / "mismatched", rank=4,
                                   target_modules=("q_proj",), seed=9)
    before = sorted(setup.upload_dir.iterdir()) if setup.upload_dir.exists() else []
    for name, body in (("corrupt", b"\x1f\x8b not really gzip"),
                       ("mismatched", tar_dir(mismatched))):
        response = admin(setup, "POST", f"/admin/adapters/upload?name={name}&owner=alpha",
                         content=body)
        assert response.status_code == 400, response.text
        assert "refused" in response.json()["error"]["message"]
        assert admin(setup, "GET", f"/admin/adapters/{name}").status_code == 404
    after = sorted(setup.upload_dir.iterdir()) if setup.upload_dir.exists() else []
    assert after == before


def test_uploaded_adapter_loads_lazily_and_reports_status(setup: Setup,
                                                          tenants: dict[str, str]) -> None:
    response = admin(setup, "POST", "/admin/adapters/upload?name=uploaded&owner=alpha",
                     content=tar_dir(setup.adapters["a-bot"]))
    assert response.status_code == 201, response.text
    status = response.json()
    assert status["owner"] == "alpha"
    # Registered on the engine (checked there), resident in a slot only once used.
    assert [(i["registered"], i["resident"]) for i in status["instances"].values()] == [
        (True, False)]
    assert complete(setup, tenants["alpha"], "uploaded").status_code == 200
    status = admin(setup, "GET", "/admin/adapters/uploaded").json()
    (instance,) = status["instances"].values()
    assert instance["registered"] is True
    assert status["requests_served"] == 1
    wait_engines_idle(setup.engine.url)
    assert admin(setup, "DELETE", "/admin/adapters/uploaded").status_code == 200
    assert complete(setup, tenants["alpha"], "uploaded").status_code == 404


# --------------------------------------------------------------------- registry, schema
def test_engines_register_and_gateways_discover_them(setup: Setup, tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    token = ("--engine-token", "registry-test-token")  # registrations are signed with it
    engine = start_engine(tiny_model_dir, tmp_path, "--num-kv-blocks", "64",
                          "--register-redis-url", setup.redis.url, *token)
    gateway = start_gateway(tiny_model_dir, [], tmp_path, "--instances", "0", "--redis-url",
                            setup.redis.url, "--admin-key", ADMIN, *token)
    try:
        engine.wait_ready()
        gateway.wait_ready()  # ready = it found a healthy instance through the registry
        listed = httpx.get(gateway.url + "/instances", timeout=10.0,
                           headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert [i["instance_id"] for i in listed] == [engine.url]
        key = new_tenant(setup, "registry-user")
        base = poll(lambda: models(setup, key), "the tenant to exist")[0]
        response = httpx.post(gateway.url + "/v1/completions", timeout=60.0,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": base, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert response.headers["x-loragate-instance"] == instance_tag(engine.url, ADMIN)
    finally:
        gateway.stop()
        engine.stop()


def test_openapi_documents_the_admin_api(setup: Setup) -> None:
    schema = httpx.get(setup.gateways[0].url + "/openapi.json", timeout=10.0).json()
    paths = set(schema["paths"])
    assert {"/admin/tenants", "/admin/tenants/{tenant_id}", "/admin/tenants/{tenant_id}/keys",
            "/admin/tenants/{tenant_id}/keys/{key_id}/rotate", "/admin/adapters",
            "/admin/adapters/upload", "/admin/adapters/{name}", "/admin/adapters/{name}/load",
            "/admin/adapters/{name}/pin", "/v1/completions", "/v1/chat/completions",
            "/v1/models"} <= paths
    ids = [operation["operationId"] for methods in schema["paths"].values()
           for operation in methods.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
