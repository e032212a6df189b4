"""Tenancy end to end: two live gateway processes sharing one real (private) Redis, in front of
one live engine. Isolation of adapters and prefix caches, keys revoked on every replica at
once, RPM/TPM exact across the replicas, a Redis outage served by the fail-open policy, and
the admin API's adapter lifecycle (upload refused cleanly, lazy load, status)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.demo_model import make_demo_model, make_peft_adapter
from engine.demo_shapes import DemoModelSpec
from gateway.exposure import instance_tag
from gateway.sliding_window import SPAN_S
from lora.targets import SUPPORTED_MODULES
from tests.adapter_lifecycle_helpers import tar_dir
from tests.live_http import metric, poll, wait_engines_idle
from tests.live_servers import running, start_engine, start_gateway
from tests.redis_server import private_redis
from tests.tenancy_helpers import (
    ADMIN,
    Setup,
    admin,
    answer_to_headers,
    below,
    complete,
    engine_hits,
    engine_holds,
    if_status,
    models,
    new_tenant,
    sees_adapter,
    tokens_counted,
)

LONG_PROMPT = list(range(10, 10 + 160))  # 10 full blocks of 16
UNSET_RESERVE = 64  # --tpm-unset-output-reserve of the gateways


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("tenancy")
    adapters = {name: make_peft_adapter(tiny_model_dir, root / name, rank=4,
                                        target_modules=SUPPORTED_MODULES, seed=i + 1, b_scale=0.2)
                for i, name in enumerate(("a-bot", "b-bot"))}
    other_model = make_demo_model(root / "other-model", DemoModelSpec(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
        num_kv_heads=1, max_position_embeddings=256, seed=3))
    redis = private_redis(root)
    upload_dir = root / "uploads"
    engine = start_engine(tiny_model_dir, root, "--num-kv-blocks", "256", "--adapter-root",
                          str(root))
    gateways = [start_gateway(tiny_model_dir, [engine.url], root, "--admin-key", ADMIN,
                              "--redis-url", redis.url, "--state-refresh-s", "0.1",
                              "--adapter-upload-dir", str(upload_dir),
                              "--tpm-unset-output-reserve", str(UNSET_RESERVE))
                for _ in range(2)]
    try:
        for server in (engine, *gateways):
            server.wait_ready()
        yield Setup(engine, gateways, redis, adapters, upload_dir, other_model)
    finally:
        for server in (*gateways, engine):
            server.stop()
        redis.stop()


@pytest.fixture(scope="module")
def tenants(setup: Setup) -> dict[str, str]:
    keys = {"alpha": new_tenant(setup, "alpha"), "beta": new_tenant(setup, "beta")}
    for name, owner in (("a-bot", "alpha"), ("b-bot", "beta")):
        response = admin(setup, "POST", "/admin/adapters", json={
            "name": name, "path": str(setup.adapters[name]), "owner": owner})
        assert response.status_code == 201, response.text
    return keys


# ----------------------------------------------------------------------------- isolation
def test_tenants_see_and_call_only_their_adapters(setup: Setup,
                                                  tenants: dict[str, str]) -> None:
    base = models(setup, tenants["alpha"])[0]
    for gateway in (0, 1):  # both replicas, once they have the adapters
        poll(functools.partial(sees_adapter, setup, tenants["alpha"], gateway, "a-bot"),
             "replica to see the adapter")
        assert models(setup, tenants["alpha"], gateway) == [base, "a-bot"]
        assert models(setup, tenants["beta"], gateway) == [base, "b-bot"]
    assert complete(setup, tenants["alpha"], "a-bot").status_code == 200
    refused = complete(setup, tenants["beta"], "a-bot")
    assert refused.status_code == 404  # not 403: beta must not learn a-bot exists
    assert refused.json()["error"]["code"] == "model_not_found"
    missing_key = httpx.post(setup.gateways[0].url + "/v1/completions",
                             json={"model": base, "prompt": "x"}, timeout=10.0)
    assert missing_key.status_code == 401
    assert missing_key.json()["error"]["code"] == "invalid_api_key"
    tenant_on_admin = httpx.get(setup.gateways[0].url + "/admin/tenants", timeout=10.0,
                                headers={"Authorization": f"Bearer {tenants['alpha']}"})
    assert tenant_on_admin.status_code == 401


def test_an_adapter_an_engine_refuses_is_a_400_at_registration(
        setup: Setup, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    # Outside the engine's --adapter-root: refused there. Recorded anyway, every request
    # for it would be a 500; the registration itself is the 400, and nothing is recorded.
    outside = make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("elsewhere") / "x",
                                rank=4, target_modules=SUPPORTED_MODULES, seed=9)
    response = admin(setup, "POST", "/admin/adapters", json={
        "name": "outsider", "path": str(outside), "public": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "path" and "adapter roots" in error["message"]
    assert admin(setup, "GET", "/admin/adapters/outsider").status_code == 404


def test_tenants_never_share_prefix_blocks(setup: Setup, tenants: dict[str, str]) -> None:
    base = models(setup, tenants["alpha"])[0]
    assert complete(setup, tenants["alpha"], base, LONG_PROMPT).status_code == 200
    wait_engines_idle(setup.engine.url)
    before = engine_hits(setup)
    assert complete(setup, tenants["beta"], base, LONG_PROMPT).status_code == 200
    assert engine_hits(setup) == before  # identical prompt, other tenant: no hit
    assert complete(setup, tenants["alpha"], base, LONG_PROMPT).status_code == 200
    assert engine_hits(setup) == before + 144  # its own blocks (capped at len - 1)


def test_a_recreated_tenant_inherits_no_adapter_and_no_cached_prefix(setup: Setup) -> None:
    key = new_tenant(setup, "omega")
    response = admin(setup, "POST", "/admin/adapters", json={
        "name": "omega-bot", "path": str(setup.adapters["a-bot"]), "owner": "omega"})
    assert response.status_code == 201, response.text
    response = admin(setup, "POST", "/admin/adapters/upload?name=omega-up&owner=omega",
                     content=tar_dir(setup.adapters["a-bot"]))
    assert response.status_code == 201, response.text
    base = models(setup, key)[0]
    prompt = list(range(300, 460))  # 10 full blocks no other test sends
    assert complete(setup, key, "omega-bot").status_code == 200
    assert complete(setup, key, base, prompt).status_code == 200
    wait_engines_idle(setup.engine.url)
    before = engine_hits(setup)
    assert complete(setup, key, base, prompt).status_code == 200
    assert engine_hits(setup) == before + 144  # the old omega's prefix is cached
    deleted = admin(setup, "DELETE", "/admin/tenants/omega")
    assert deleted.status_code == 200
    assert deleted.json()["adapters_deleted"] == ["omega-bot", "omega-up"]
    for name in ("omega-bot", "omega-up"):
        assert admin(setup, "GET", f"/admin/adapters/{name}").status_code == 404
    assert not (setup.upload_dir / "omega-up").exists()  # its upload is gone
    assert setup.adapters["a-bot"].is_dir()  # a directory registered by path is not
    new_key = new_tenant(setup, "omega")
    assert "omega-bot" not in models(setup, new_key)
    refused = complete(setup, new_key, "omega-bot")
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "model_not_found"
    wait_engines_idle(setup.engine.url)
    before = engine_hits(setup)
    assert complete(setup, new_key, base, prompt).status_code == 200
    assert engine_hits(setup) == before  # same id, new tenant: none of the old blocks


def test_a_tenant_deleted_while_its_adapters_run_unloads_them_when_their_requests_end(
        setup: Setup) -> None:
    key = new_tenant(setup, "busy")
    names = ("busy-bot", "busy-forced")  # the second one's own DELETE is pending already
    for name, path in zip(names, (setup.adapters["b-bot"], setup.adapters["a-bot"]),
                          strict=True):
        response = admin(setup, "POST", "/admin/adapters", json={
            "name": name, "path": str(path), "owner": "busy"})
        assert response.status_code == 201, response.text

    def stream(model: str) -> contextlib.AbstractContextManager[httpx.Response]:
        body = {"model": model, "prompt": "hello", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        return httpx.stream("POST", setup.gateways[0].url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}, timeout=60.0)

    with stream(names[0]) as first, stream(names[1]) as second:
        streams = [first.iter_lines(), second.iter_lines()]
        for lines in streams:
            assert next(line for line in lines if line.startswith("data: "))
        forced = admin(setup, "DELETE", f"/admin/adapters/{names[1]}?force=true")
        assert forced.status_code == 202, forced.text
        deleted = admin(setup, "DELETE", "/admin/tenants/busy")
        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["adapters_deleted"] == sorted(names)
        assert deleted.json()["adapters_pending_delete"] == sorted(names)
        # Each engine's answer by its opaque id (as x-loragate-instance), never its URL.
        tag = instance_tag(setup.engine.url, ADMIN)
        assert all(set(answers) <= {tag} for answers in deleted.json()["unloaded"].values())
        assert "http://" not in forced.text + deleted.text, forced.text + deleted.text
        for name in names:
            assert engine_holds(setup, name)  # their requests still run on them
            # The names stay taken until the engines let the old weights go.
            assert admin(setup, "GET", f"/admin/adapters/{name}").json()["status"] == \
                "deleting"
            again = admin(setup, "POST", "/admin/adapters", json={
                "name": name, "path": str(setup.adapters["a-bot"]), "public": True})
            assert again.status_code == 409, again.text
            assert again.json()["error"]["code"] == "adapter_deleting"
        for lines in streams:
            rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]" and "error" not in rest[-2]  # and finish
    def gone(name: str) -> bool:
        return not engine_holds(setup, name) and \
            admin(setup, "GET", f"/admin/adapters/{name}").status_code == 404

    for name in names:
        poll(functools.partial(gone, name), f"the engine to unload {name} and its record to go")


def test_a_registration_refused_after_loading_leaves_no_adapter_on_the_engines(
        setup: Setup) -> None:
    response = admin(setup, "POST", "/admin/adapters", json={
        "name": "orphan", "path": str(setup.adapters["a-bot"]), "owner": "no-such-tenant"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "owner"
    assert not engine_holds(setup, "orphan")
    assert admin(setup, "GET", "/admin/adapters/orphan").status_code == 404


def test_shared_salt_must_be_a_safe_name(setup: Setup) -> None:
    refused = admin(setup, "POST", "/admin/tenants",
                    json={"tenant_id": "slash", "shared_salt": "a/b"})
    assert refused.status_code == 400
    assert "shared_salt" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "shared_salt"
    for field, value in (("rpm", -1), ("priority", 1000)):
        bad = admin(setup, "POST", "/admin/tenants", json={"tenant_id": "bad", field: value})
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, field), bad.text
    assert admin(setup, "GET", "/admin/tenants/slash").status_code == 404
    new_tenant(setup, "salted", shared_salt="group-1")
    patched = admin(setup, "PATCH", "/admin/tenants/salted", json={"shared_salt": "x/y"})
    assert patched.status_code == 400
    assert admin(setup, "GET", "/admin/tenants/salted").json()["shared_salt"] == "group-1"


def test_revoked_key_fails_at_once_on_every_replica(setup: Setup) -> None:
    key = new_tenant(setup, "gamma")
    base = poll(lambda: models(setup, key, 1), "replica 1 to know gamma")[0]
    assert complete(setup, key, base, gateway=1).status_code == 200
    key_id = admin(setup, "GET", "/admin/tenants/gamma/keys").json()[0]["key_id"]
    assert admin(setup, "DELETE", f"/admin/tenants/gamma/keys/{key_id}").status_code == 200
    refused = complete(setup, key, base, gateway=1)  # no wait: the other replica
    assert refused.status_code == 401


def test_adapter_changes_hold_at_once_on_a_replica_that_reloads_rarely(
        setup: Setup, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A replica that reloads its view once a minute still honours, for every request that
    starts after the change, an adapter's new owner and its deletion made through another
    replica; it never loads the deleted adapter back onto the engine; and the name
    registered again counts its usage from zero there. Keys issued through the other
    replica work at once too, even in a burst, and so do a tenant's new settings: a shared
    salt withdrawn, a lower RPM."""
    slow = start_gateway(tiny_model_dir, [setup.engine.url], tmp_path, "--admin-key", ADMIN,
                         "--redis-url", setup.redis.url, "--state-refresh-s", "60",
                         "--adapter-upload-dir", str(setup.upload_dir))
    with running(slow):
        pair = dataclasses.replace(setup, gateways=[setup.gateways[0], slow])
        first, second = (new_tenant(pair, name, shared_salt="kl")
                         for name in ("kappa", "lambda"))
        # A key issued a moment ago through the other replica, in a burst: every request
        # waits for the same catch-up with the store, none is a 401.
        base = models(pair, first)[0]
        with concurrent.futures.ThreadPoolExecutor(6) as burst:
            statuses = list(burst.map(
                lambda _: complete(pair, second, base, gateway=1).status_code, range(6)))
        assert statuses == [200] * 6
        assert complete(pair, first, base, LONG_PROMPT).status_code == 200
        wait_engines_idle(pair.engine.url)
        assert admin(pair, "PATCH", "/admin/tenants/lambda", json={"shared_salt": None,
                                                                  "rpm": 7}).status_code == 200
        hits = engine_hits(pair)
        assert complete(pair, second, base, LONG_PROMPT, gateway=1).status_code == 200
        assert engine_hits(pair) == hits  # kappa's blocks are no longer lambda's
        limited = complete(pair, second, base, gateway=1)  # its 8th request this minute
        assert limited.status_code == 429 and limited.json()["error"]["code"] == "rpm_exceeded"
        assert admin(pair, "PATCH", "/admin/tenants/lambda", json={"rpm": None}
                     ).status_code == 200
        assert admin(pair, "POST", "/admin/adapters", json={
            "name": "k-bot", "path": str(setup.adapters["a-bot"]), "owner": "kappa"}
                     ).status_code == 201
        assert complete(pair, first, "k-bot", gateway=1).status_code == 200
        assert admin(pair, "GET", "/admin/adapters/k-bot", gateway=1
                     ).json()["requests_served"] == 1
        assert admin(pair, "PATCH", "/admin/adapters/k-bot", json={"owner": "lambda"}
                     ).status_code == 200
        assert complete(pair, first, "k-bot", gateway=1).status_code == 404
        assert complete(pair, second, "k-bot", gateway=1).status_code == 200
        assert admin(pair, "DELETE", "/admin/adapters/k-bot").status_code == 200
        assert not engine_holds(pair, "k-bot")
        refused = complete(pair, second, "k-bot", gateway=1)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
        assert not engine_holds(pair, "k-bot")
        assert admin(pair, "POST", "/admin/adapters", json={
            "name": "k-bot", "path": str(setup.adapters["b-bot"]), "owner": "lambda"}
                     ).status_code == 201
        again = admin(pair, "GET", "/admin/adapters/k-bot", gateway=1).json()
        assert (again["requests_served"], again["tokens_served"]) == (0, 0)
        assert admin(pair, "DELETE", "/admin/adapters/k-bot").status_code == 200


# ---------------------------------------------------------------------------- rate limits
def test_rpm_is_exact_across_two_gateways(setup: Setup) -> None:
    key = new_tenant(setup, "delta", rpm=4)
    base = poll(lambda: models(setup, key, 1), "replica 1 to know delta")[0]
    statuses = [complete(setup, key, base, gateway=i % 2) for i in range(6)]
    assert [r.status_code for r in statuses].count(200) == 4
    limited = [r for r in statuses if r.status_code == 429]
    assert len(limited) == 2
    for response in limited:
        assert 1 <= int(response.headers["retry-after"]) <= SPAN_S  # sliding: up to 61 s
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
    assert first.json()["usage"]["total_tokens"] == 48
    refused = poll(lambda: if_status(complete(setup, key, base, gateway=1), 429),
                   "the charge to reach the shared counter", timeout_s=5)
    assert refused.json()["error"]["code"] == "tpm_exceeded"


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
def test_bad_uploads_are_refused_and_leave_nothing(setup: Setup, tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
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
