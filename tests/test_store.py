"""Both state stores pass the same suite: records, versions, rate-limit windows, expiry,
revocation, engine heartbeats. RedisStore runs against a real Redis (REDIS_URL)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
import redis

from gateway.redis_store import RedisStore
from gateway.store import WINDOW_S, MemoryStore, StateStore
from gateway.tenancy import AdapterRecord, ApiKey, Tenant, hash_key
from tests.redis_server import shared_redis_url

T = TypeVar("T")
NOW = 1_000_000 * WINDOW_S + 10.0  # 10 s into a window


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


@pytest.fixture(params=["memory", "redis"])
def make_store(request: pytest.FixtureRequest) -> Iterator[Callable[[], StateStore]]:
    """A factory: every call is one gateway's view of the same shared state."""
    if request.param == "memory":
        store = MemoryStore()
        yield lambda: store
        return
    url = shared_redis_url()
    prefix = f"lg-test-{uuid.uuid4().hex[:8]}:"
    yield lambda: RedisStore(url, prefix=prefix)
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)


def test_records_round_trip_and_bump_the_version(make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store = make_store()
        assert (await store.snapshot()).tenants == {}
        v0 = await store.version()
        tenant = Tenant("acme", "Acme", priority=2, rpm=10, tpm=1000, max_concurrency=3,
                        shared_salt="partners")
        key = ApiKey(hash_key("secret"), "acme", "k1", 123.0)
        adapter = AdapterRecord("bot", "/adapters/bot", owner="acme", shared_with=("beta",))
        await store.put_tenant(tenant)
        await store.put_key(key)
        await store.put_adapter(adapter)
        assert await store.version() == v0 + 3
        other = make_store()  # a second gateway sees the same records
        snapshot = await other.snapshot()
        assert snapshot.version == v0 + 3
        assert snapshot.tenants == {"acme": tenant}
        assert snapshot.keys == {key.key_hash: key}
        assert snapshot.adapters == {"bot": adapter}
        await store.delete_tenant("acme")  # takes its keys with it
        snapshot = await other.snapshot()
        assert snapshot.tenants == {} and snapshot.keys == {}
        assert snapshot.adapters == {"bot": adapter}
        await store.delete_adapter("bot")
        assert (await other.snapshot()).adapters == {}
        assert await other.version() == v0 + 5
        await store.close()
        await other.close()

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
        assert {r.retry_after_s for r in refused} == {WINDOW_S - 10}
        await a.refund("acme", allowed[0].window)
        assert (await b.admit(None, "acme", 20, None, now=NOW)).allowed
        assert not (await b.admit(None, "acme", 20, None, now=NOW)).allowed
        # The next window starts from zero.
        assert (await a.admit(None, "acme", 20, None, now=NOW + WINDOW_S)).allowed
        await a.close()
        await b.close()

    run(scenario())


def test_tpm_counts_charged_tokens(make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store = make_store()
        first = await store.admit(None, "acme", rpm=None, tpm=100, now=NOW)
        assert first.allowed
        await store.charge("acme", 60, first.window)
        assert (await store.admit(None, "acme", None, 100, now=NOW)).allowed
        await store.charge("acme", 40, first.window)
        refused = await store.admit(None, "acme", None, 100, now=NOW + 5)
        assert (refused.allowed, refused.reason, refused.retry_after_s) == (
            False, "tpm", WINDOW_S - 15)
        assert (await store.admit(None, "other", None, 100, now=NOW)).allowed  # per tenant
        await store.close()

    run(scenario())


def test_admit_refuses_a_revoked_key_at_once(make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store, other = make_store(), make_store()
        key = ApiKey(hash_key("secret"), "acme", "k1", 0.0)
        await store.put_key(key)
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

    async def admit_once() -> int:
        store = RedisStore(url, prefix=prefix)
        admission = await store.admit(None, "acme", 5, 5, now=NOW)
        await store.close()
        return admission.window

    window = run(admit_once())
    client = redis.Redis.from_url(url)
    key = f"{prefix}rl:acme:{window}"
    assert 0 < int(client.ttl(key)) <= 2 * WINDOW_S
    client.delete(key)
    memory = MemoryStore()
    for offset in range(3):
        run(memory.admit(None, "acme", 5, 5, now=NOW + offset * WINDOW_S))
    assert sorted(w for _, w in memory._counters) == [window + 1, window + 2]


def test_engine_heartbeats_expire(make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        store = make_store()
        await store.register_engine("http://a:1", ttl_s=60)
        await store.register_engine("http://b:1", ttl_s=-1)  # already expired
        assert await make_store().engines() == ["http://a:1"]
        await store.close()

    run(scenario())
