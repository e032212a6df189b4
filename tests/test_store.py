"""Both state stores pass the same suite: records, versions, sliding rate-limit windows,
expiry, revocation, engine heartbeats; RedisStore's snapshot survives unreadable records.
RedisStore runs against a real Redis (REDIS_URL)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from gateway.redact import redact_text, redact_url
from gateway.redis_store import RedisStore
from gateway.sliding_window import SPAN_S
from gateway.store import MemoryStore, Snapshot, StateStore, StoreUnavailable
from gateway.tenancy import AdapterRecord, ApiKey, Tenant, hash_key
from tests.redis_server import private_redis, shared_redis_url

T = TypeVar("T")
NOW = 60_000_010.0


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]




def test_records_round_trip_and_bump_the_version(make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store = make_store()
        assert (await store.snapshot()).tenants == {}
        v0 = await store.version()
        tenant = Tenant("acme", "Acme", priority=2, rpm=10, tpm=1000, max_concurrency=3,
                        shared_salt="partners")
        key = ApiKey(hash_key("secret"), "acme", "k1", 123.0)
        adapter = AdapterRecord("bot", "/adapters/bot", owner="acme", shared_with=("beta",),
                                owner_uid=tenant.uid)
        assert await store.swap_tenant(tenant.tenant_id, None, tenant)
        assert await store.put_key(key)
        assert await store.swap_adapter("bot", None, adapter)
        assert await store.version() == v0 + 3
        other = make_store()  # a second gateway sees the same records
        snapshot = await other.snapshot()
        assert snapshot.version == v0 + 3
        assert snapshot.tenants == {"acme": tenant}
        assert snapshot.keys == {key.key_hash: key}
        assert snapshot.adapters == {"bot": adapter}
        await store.delete_adapter("bot")
        assert (await other.snapshot()).adapters == {}
        assert await other.version() == v0 + 4
        await store.close()
        await other.close()

    run(scenario())


def test_swap_adapter_changes_only_the_record_it_was_given(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store, other = make_store(), make_store()
        first = AdapterRecord("bot", "/a", owner="acme")
        second = AdapterRecord("bot", "/b", owner="beta")
        v0 = await store.version()
        assert await store.swap_adapter("bot", None, first)
        assert not await other.swap_adapter("bot", None, second)  # the name is taken
        assert not await other.swap_adapter("bot", second, None)  # not the record there
        assert await other.version() == v0 + 1  # refusals write nothing
        hidden = dataclasses.replace(first, deleting=True)
        assert await other.swap_adapter("bot", first, hidden)
        assert not await store.swap_adapter("bot", first, second)  # read before the change
        assert (await store.snapshot()).adapters == {"bot": hidden}
        assert await store.swap_adapter("bot", hidden, None)
        assert (await other.snapshot()).adapters == {}
        await store.close()
        await other.close()

    run(scenario())


def test_one_of_many_racing_registrations_takes_a_name(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        stores = [make_store() for _ in range(4)]  # four gateways sharing the state
        records = [AdapterRecord("bot", f"/adapters/{i}") for i in range(16)]
        won = await asyncio.gather(*(stores[i % 4].swap_adapter("bot", None, r)
                                     for i, r in enumerate(records)))
        assert sum(won) == 1
        assert (await stores[0].snapshot()).adapters == {"bot": records[won.index(True)]}
        for store in stores:
            await store.close()

    run(scenario())


def test_deleting_a_tenant_takes_its_keys_and_adapters_and_shares(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store = make_store()
        acme, beta = Tenant("acme"), Tenant("beta")
        records = [AdapterRecord("mine", "/m", owner="acme", owner_uid=acme.uid),
                   AdapterRecord("theirs", "/t", owner="beta", owner_uid=beta.uid,
                                 shared_with=("acme", "gamma")),
                   AdapterRecord("public", "/p")]
        for tenant in (acme, beta):
            assert await store.swap_tenant(tenant.tenant_id, None, tenant)
            assert await store.put_key(ApiKey(hash_key(tenant.tenant_id), tenant.tenant_id,
                                              "k", 0.0))
        for record in records:
            assert await store.swap_adapter(record.name, None, record)
        v0 = await store.version()
        assert await store.delete_tenant("acme", "an-earlier-incarnation") is None
        assert await store.version() == v0  # a refused delete writes nothing
        assert await store.delete_tenant("acme", acme.uid) == ["mine"]
        snapshot = await make_store().snapshot()
        assert snapshot.version == v0 + 1  # one atomic change
        assert list(snapshot.tenants) == ["beta"]
        assert [k.tenant_id for k in snapshot.keys.values()] == ["beta"]
        assert snapshot.adapters == {
            "theirs": AdapterRecord("theirs", "/t", owner="beta", owner_uid=beta.uid,
                                    shared_with=("gamma",)),
            "public": records[2]}
        await store.close()

    run(scenario())


def test_rpm_is_exact_across_gateways_and_refunds_give_back(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        a, b = make_store(), make_store()
        results = await asyncio.gather(*(
            (a if i % 2 else b).admit(None, "acme", rpm=20, tpm=None, now=NOW)
            for i in range(50)))
        allowed = [r for r in results if r.allowed]
        refused = [r for r in results if not r.allowed]
        assert len(allowed) == 20
        assert {r.reason for r in refused} == {"rpm"}
        assert {r.retry_after_s for r in refused} == {SPAN_S}  # the second NOW frees at +61
        await a.refund("acme", allowed[0].second, now=NOW)
        assert (await b.admit(None, "acme", 20, None, now=NOW)).allowed
        assert not (await b.admit(None, "acme", 20, None, now=NOW)).allowed
        # Sliding: still full 60 s later, empty once the second NOW left the window.
        assert not (await a.admit(None, "acme", 20, None, now=NOW + 60.9)).allowed
        assert (await a.admit(None, "acme", 20, None, now=NOW + SPAN_S)).allowed
        await a.close()
        await b.close()

    run(scenario())


def test_tpm_counts_reserved_and_charged_tokens(make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store = make_store()
        first = await store.admit(None, "acme", rpm=None, tpm=100, now=NOW)
        assert first.allowed
        assert (await store.reserve("acme", 60, 100, now=NOW)).allowed
        refused = await store.reserve("acme", 41, 100, now=NOW + 5)
        assert (refused.allowed, refused.reason, refused.retry_after_s) == (
            False, "tpm", SPAN_S - 5)
        await store.charge("acme", -20, first.second, now=NOW + 5)  # unused part back
        second = await store.reserve("acme", 60, 100, now=NOW + 5)
        assert (second.allowed, second.second) == (True, int(NOW) + 5)
        refused = await store.admit(None, "acme", None, 100, now=NOW + 6)
        assert (refused.allowed, refused.reason) == (False, "tpm")
        assert (await store.admit(None, "other", None, 100, now=NOW)).allowed  # per tenant
        # A refund never takes a second below zero (40 stay counted in the first one).
        await store.charge("acme", -1000, second.second, now=NOW + 6)
        assert (await store.reserve("acme", 60, 100, now=NOW + 7)).allowed
        assert not (await store.reserve("acme", 1, 100, now=NOW + 7)).allowed
        await store.close()

    run(scenario())


def test_admit_refuses_a_revoked_key_at_once(make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store, other = make_store(), make_store()
        acme = Tenant("acme")
        key = ApiKey(hash_key("secret"), "acme", "k1", 0.0, acme.uid)
        assert await store.swap_tenant("acme", None, acme)
        assert await store.put_key(key)
        assert (await other.admit(key.key_hash, "acme", None, None, now=NOW)).allowed
        await store.delete_key(key.key_hash)
        revoked = await other.admit(key.key_hash, "acme", None, None, now=NOW)
        assert (revoked.allowed, revoked.reason) == (False, "revoked")
        await store.close()
        await other.close()

    run(scenario())


def test_rate_counters_expire() -> None:
    url = shared_redis_url()
    prefix = f"lg-test-{uuid.uuid4().hex[:8]}:"

    async def admit_once(now: float) -> None:
        store = RedisStore(url, prefix=prefix)
        assert (await store.admit(None, "acme", 5, 5, now=now)).allowed
        assert (await store.reserve("acme", 2, 5, now=now)).allowed
        await store.close()

    run(admit_once(NOW))
    client = redis.Redis.from_url(url, decode_responses=True)
    for kind in ("req", "tok"):
        key = f"{prefix}rl:acme:{kind}"
        assert 0 < int(client.ttl(key)) <= SPAN_S + 1
    run(admit_once(NOW + SPAN_S))  # the older second is pruned from the hash
    assert client.hgetall(f"{prefix}rl:acme:req") == {str(int(NOW + SPAN_S)): "1"}
    client.delete(f"{prefix}rl:acme:req", f"{prefix}rl:acme:tok")
    memory = MemoryStore()
    for offset in range(3):
        run(memory.admit(None, "acme", 5, 5, now=NOW + offset * SPAN_S))
    assert memory.rate_buckets("acme") == {"req": {int(NOW) + 2 * SPAN_S: 1}, "tok": {}}


def test_snapshot_skips_unreadable_records_and_ignores_unknown_fields(
        caplog: pytest.LogCaptureFixture) -> None:
    url = shared_redis_url()
    prefix = f"lg-test-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(url)
    acme = Tenant("acme")
    key = ApiKey(hash_key("k"), "acme", "k1", 1.0)
    future_tenant = {**asdict(Tenant("future", rpm=5)), "region": "eu"}
    raw = {
        "tenants": {"broken": "{not json", "wrong": json.dumps({"tenant_id": "wrong",
                                                                 "rpm": "lots"}),
                    "future": json.dumps(future_tenant),
                    "legacy": json.dumps({"tenant_id": "legacy", "name": "old"}),
                    "alias": json.dumps(asdict(Tenant("other")))},
        "keys": {"junk": "[1, 2]"},
        "adapters": {"bad": json.dumps({"name": "bad"}),
                     "new": json.dumps({"name": "new", "path": "/n", "quantized": True})},
    }

    async def scenario() -> Snapshot:
        store = RedisStore(url, prefix=prefix)
        assert await store.swap_tenant(acme.tenant_id, None, acme)
        assert await store.put_key(key)
        for table, records in raw.items():
            for name, value in records.items():
                client.hset(prefix + table, name, value)
        first = await store.snapshot()
        assert await store.snapshot() == first
        await store.close()
        return first

    try:
        with caplog.at_level(logging.WARNING, logger="gateway.redis_store"):
            snapshot = run(scenario())
    finally:
        client.delete(*client.scan_iter(match=prefix + "*"))
    del future_tenant["region"]
    assert snapshot.tenants == {"acme": acme, "future": Tenant(**future_tenant),
                                "legacy": Tenant("legacy", "old", uid="")}
    assert snapshot.tenants["legacy"].cache_salt == "tenant:legacy"  # as before uids
    assert snapshot.keys == {key.key_hash: key}
    assert snapshot.adapters == {"new": AdapterRecord("new", "/n")}
    warned = sorted(r.getMessage().split(":")[0] for r in caplog.records)
    assert warned == ["ignoring unknown fields of adapters record 'new'",
                      "ignoring unknown fields of tenants record 'future'",
                      "skipping unreadable adapters record 'bad'",
                      "skipping unreadable keys record 'junk'",
                      "skipping unreadable tenants record 'alias'",
                      "skipping unreadable tenants record 'broken'",
                      "skipping unreadable tenants record 'wrong'"]  # once each


def test_engine_heartbeats_expire(make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store = make_store()
        await store.register_engine("http://a:1", ttl_s=60)
        await store.register_engine("http://b:1", ttl_s=-1)  # already expired
        assert await make_store().engines() == ["http://a:1"]
        await store.close()

    run(scenario())


@pytest.mark.parametrize(("raw", "shown"), [
    ("redis://:secretpw@10.0.0.1:6379/0", "redis://***@10.0.0.1:6379/0"),
    ("rediss://user:secretpw@h/1?password=secretpw&ssl_cert_reqs=none",
     "rediss://***@h/1?password=***&ssl_cert_reqs=none"),
    ("unix://:secretpw@/run/redis.sock?db=2", "unix://***@/run/redis.sock?db=2"),
    ("redis://10.0.0.1:6379/0", "redis://10.0.0.1:6379/0"),
])
def test_redis_urls_are_shown_without_credentials(raw: str, shown: str) -> None:
    assert redact_url(raw) == shown
    assert redact_text(f"error talking to {raw}: refused") == (
        f"error talking to {shown}: refused")



def test_redis_store_survives_a_server_restart_without_failing_requests(tmp_path: Path) -> None:
    # Every pooled connection dies with the server: each is reconnected once on its next
    # use, so no request after the restart sees StoreUnavailable; with the server down,
    # a call still fails fast.
    server = private_redis(tmp_path)

    async def scenario() -> None:
        store = RedisStore(server.url)
        try:
            # Several connections in the pool: concurrent calls each take one.
            await asyncio.gather(*(store.snapshot() for _ in range(6)))
            server.stop()
            with pytest.raises(StoreUnavailable):
                await store.snapshot()
            server.start()
            for _ in range(8):
                await asyncio.gather(*(store.snapshot() for _ in range(6)))
        finally:
            await store.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_refused_password_is_not_called_unreachable(tmp_path: Path) -> None:
    from gateway.redis_store import check_reachable

    store = private_redis(tmp_path, password="right")
    try:
        wrong = store.url.replace(":right@", ":wrong@")
        with pytest.raises(ValueError) as refused:
            check_reachable(wrong)
        assert str(refused.value).startswith(
            f"the state store at redis://***@127.0.0.1:{store.port}/0 refused the connection: "
            "authentication failed")
        assert "wrong" not in str(refused.value)
        check_reachable(store.url)
    finally:
        store.stop()
