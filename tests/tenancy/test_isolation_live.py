"""Tenancy end to end (tests/tenancy/conftest.py's setup): isolation of adapters and prefix
caches between tenants, and changes made through one replica (keys revoked, adapters
re-owned or deleted, a tenant's settings) holding at once on the other."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
from pathlib import Path

import httpx
import pytest

from engine.demo_model import make_peft_adapter
from gateway.exposure import instance_tag
from lora.targets import SUPPORTED_MODULES
from tests.adapter_lifecycle_helpers import tar_dir
from tests.live_http import poll, wait_engines_idle
from tests.live_servers import running, start_gateway
from tests.tenancy_helpers import (
    ADMIN,
    Setup,
    admin,
    complete,
    engine_hits,
    engine_holds,
    models,
    new_tenant,
    sees_adapter,
)

LONG_PROMPT = list(range(10, 10 + 160))  # 10 full blocks of 16


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
