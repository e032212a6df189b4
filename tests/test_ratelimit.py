"""RateLimiter over both stores (a real Redis for RedisStore): TPM reservations on a sliding
60 s window that a burst at a minute boundary cannot double, refunds of unused tokens,
exactness across two gateways, RPM on the same sliding window, and the failure policies."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import pytest
from prometheus_client import CollectorRegistry

from engine.http.errors import ApiError
from gateway.auth import Principal
from gateway.ratelimit import FailurePolicy, RateLimiter, Ticket
from gateway.redis_store import RedisStore
from gateway.serve import free_port
from gateway.store import StateStore
from gateway.tenancy import Tenant

T = TypeVar("T")
T0 = 1_000_000 * 60.0
"""A minute boundary: offsets below are seconds relative to it."""


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


@dataclass
class Clock:
    now: float = T0

    def __call__(self) -> float:
        return self.now

    def at(self, offset: float) -> Clock:
        self.now = T0 + offset
        return self




def limiter(store: StateStore, clock: Clock, policy: FailurePolicy = "open") -> RateLimiter:
    return RateLimiter(store, CollectorRegistry(), policy, clock=clock)


def caller(**limits: int) -> Principal:
    return Principal(Tenant("acme", **limits))  # type: ignore[arg-type]


async def take(lim: RateLimiter, principal: Principal, tokens: int) -> Ticket | ApiError:
    """admit() then reserve(): the ticket, or the ApiError that refused it (released)."""
    ticket = None
    try:
        ticket = await lim.admit(principal)
        await lim.reserve(ticket, tokens)
        assert ticket is not None
        return ticket
    except ApiError as exc:
        await lim.release(ticket, 0, reached_engine=False)
        return exc


def max_in_any_minute(served: list[tuple[float, int]]) -> int:
    """Most tokens served in any closed 60 s interval (the worst one starts at a serve)."""
    return max(sum(n for s, n in served if t <= s <= t + 60) for t, _ in served)


def test_tpm_burst_across_a_minute_boundary_never_exceeds_the_limit(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        clock = Clock()
        lim = limiter(make_store(), clock)
        principal = caller(tpm=300)
        served: list[tuple[float, int]] = []
        refusals: dict[float, ApiError] = {}
        # Three bursts of four 100-token requests: at :59 of one minute, just after the
        # boundary, and one minute after the first burst. Fixed windows served 600 tokens
        # within 1.2 s here; the sliding window serves 300 per any 60 s.
        for offset in (-1.0, -1.0, -1.0, -1.0, 0.2, 0.2, 0.2, 30.0, 59.5,
                       60.0, 60.0, 60.0, 60.0):
            clock.at(offset)
            result = await take(lim, principal, 100)
            if isinstance(result, ApiError):
                refusals.setdefault(offset, result)
            else:
                served.append((clock.now, 100))
                await lim.release(result, 100, reached_engine=True)
        assert [t - T0 for t, _ in served] == [-1.0, -1.0, -1.0, 60.0, 60.0, 60.0]
        assert max_in_any_minute(served) == 300
        refused = refusals[0.2]
        assert (refused.status, refused.code) == (429, "tpm_exceeded")
        assert refused.headers["Retry-After"] == "60"  # :59's tokens free at +60.0
        assert "300 tokens per minute" in refused.message
        assert refusals[59.5].headers["Retry-After"] == "1"

    run(scenario())


def test_retry_after_is_when_enough_tokens_are_free(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        clock = Clock()
        lim = limiter(make_store(), clock)
        principal = caller(tpm=300)
        for offset, tokens in ((10.0, 100), (20.0, 150)):
            clock.at(offset)
            ticket = await take(lim, principal, tokens)
            assert isinstance(ticket, Ticket)
            await lim.release(ticket, tokens, reached_engine=True)
        clock.at(25.0)
        refused = await take(lim, principal, 100)  # 250 used: needs the :10 bucket's 100
        assert isinstance(refused, ApiError)
        assert refused.headers["Retry-After"] == str(71 - 25)
        assert isinstance(await take(lim, principal, 50), Ticket)  # 50 still fit now
        clock.at(71.0)
        assert isinstance(await take(lim, principal, 100), Ticket)

    run(scenario())


def test_release_refunds_unused_and_unserved_reservations(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        clock = Clock().at(5.0)
        lim = limiter(make_store(), clock)
        principal = caller(tpm=300)
        ticket = await take(lim, principal, 200)  # prompt + max_tokens
        assert isinstance(ticket, Ticket)
        await lim.release(ticket, 50, reached_engine=True)  # stopped early: 150 back
        ticket = await take(lim, principal, 250)
        assert isinstance(ticket, Ticket)
        await lim.release(ticket, 0, reached_engine=False)  # never ran: all 250 back
        ticket = await take(lim, principal, 250)
        assert isinstance(ticket, Ticket)
        await lim.release(ticket, 250, reached_engine=True)
        refused = await take(lim, principal, 1)  # 300 used
        assert isinstance(refused, ApiError) and refused.code == "tpm_exceeded"
        # Used more than reserved (reserve() not called): the excess is charged.
        clock.at(70.0)
        admitted = await lim.admit(principal)
        await lim.release(admitted, 280, reached_engine=True)
        refused = await take(lim, principal, 30)
        assert isinstance(refused, ApiError) and refused.code == "tpm_exceeded"

    run(scenario())


def test_two_gateways_cannot_both_take_the_last_tokens(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        clock = Clock().at(30.0)
        gateways = [limiter(make_store(), clock), limiter(make_store(), clock)]
        principal = caller(tpm=300)
        tickets = [await gateways[i % 2].admit(principal) for i in range(10)]
        results = await asyncio.gather(*(
            gateways[i % 2].reserve(ticket, 100) for i, ticket in enumerate(tickets)),
            return_exceptions=True)
        refused = [r for r in results if isinstance(r, ApiError)]
        assert len(refused) == 7 and {r.code for r in refused} == {"tpm_exceeded"}
        assert results.count(None) == 3

    run(scenario())


def test_a_burst_cannot_pass_max_concurrency_during_the_store_round_trip(
        make_store: Callable[[], StateStore]) -> None:
    # Eight requests at one instant: with Redis each admit awaits a round trip, and a slot
    # counted only after it let all eight in. Refused ones give their slot back.
    async def scenario() -> None:
        lim = limiter(make_store(), Clock().at(5.0))
        principal = caller(max_concurrency=2, rpm=1000)
        results = await asyncio.gather(*(lim.admit(principal) for _ in range(8)),
                                       return_exceptions=True)
        admitted = [r for r in results if isinstance(r, Ticket)]
        refused = [r for r in results if isinstance(r, ApiError)]
        assert len(admitted) == 2 and {r.code for r in refused} == {"concurrency_limit_exceeded"}
        for ticket in admitted:
            await lim.release(ticket, 0, reached_engine=False)
        assert isinstance(await lim.admit(principal), Ticket)  # the slots came back

    run(scenario())


def test_a_tenant_created_again_under_its_id_starts_with_fresh_limits(
        make_store: Callable[[], StateStore]) -> None:
    """Its windows and requests in flight are the old incarnation's no more; the old one's
    request still running settles against the old counters."""
    async def scenario() -> None:
        lim = limiter(make_store(), Clock().at(5.0))
        old, again = (Principal(Tenant("acme", rpm=2, tpm=300, max_concurrency=1))
                      for _ in range(2))
        running = await take(lim, old, 300)
        assert isinstance(running, Ticket)
        refused = await take(lim, old, 1)
        assert isinstance(refused, ApiError) and refused.code == "concurrency_limit_exceeded"
        assert "has 1 requests in flight, its max_concurrency is 1" in refused.message
        fresh = await take(lim, again, 300)  # the old one's request is still in flight
        assert isinstance(fresh, Ticket)
        await lim.release(running, 10, reached_engine=True)  # its refund is the old one's
        await lim.release(fresh, 300, reached_engine=True)
        spent = await take(lim, again, 1)
        assert isinstance(spent, ApiError) and spent.code == "tpm_exceeded"

    run(scenario())


def test_a_reservation_over_the_whole_tpm_is_refused_as_never_fitting(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        clock = Clock().at(1.0)
        lim = limiter(make_store(), clock)
        principal = caller(tpm=300)
        refused = await take(lim, principal, 301)
        assert isinstance(refused, ApiError)
        assert (refused.status, refused.code, refused.param) == (
            429, "tpm_exceeded", "max_tokens")
        assert "can never fit" in refused.message and "max_tokens" in refused.message
        assert "Retry-After" not in refused.headers  # waiting never helps
        assert refused.headers["x-should-retry"] == "false"  # the openai SDK's retries
        assert isinstance(await take(lim, principal, 300), Ticket)  # nothing was taken

    run(scenario())


def test_an_unset_max_tokens_reserves_only_what_the_tpm_leaves_beside_the_prompt(
        make_store: Callable[[], StateStore]) -> None:
    """A chat client that sets no max_tokens is not refused for the output reserve it never
    asked for: 40 prompt tokens + a 1024 reserve under a TPM of 100 reserve 100; only a
    prompt the limit cannot hold (with one token of output) never fits."""
    async def scenario() -> None:
        lim = limiter(make_store(), Clock().at(1.0))
        principal = caller(tpm=100)
        ticket = await lim.admit(principal)
        await lim.reserve(ticket, 40 + 1024, prompt_tokens=40)
        assert ticket is not None and ticket.reserved == 100
        assert isinstance(await take(lim, principal, 1), ApiError)  # the window is full
        await lim.release(ticket, 45, reached_engine=True)  # 55 back
        assert isinstance(await take(lim, principal, 55), Ticket)
        lim = limiter(make_store(), Clock().at(200.0))
        ticket = await lim.admit(principal)
        with pytest.raises(ApiError) as refused:
            await lim.reserve(ticket, 100 + 1024, prompt_tokens=100)
        assert (refused.value.code, refused.value.param) == ("tpm_exceeded", None)
        assert "its prompt and one token of output come to 101 tokens" in \
            refused.value.message and "shorten the prompt" in refused.value.message

    run(scenario())


def test_tickets_and_refusals_carry_openais_ratelimit_headers(
        make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        clock = Clock()
        lim = limiter(make_store(), clock)
        principal = caller(rpm=3, tpm=500)
        clock.at(1.0)
        first = await take(lim, principal, 100)
        assert isinstance(first, Ticket)
        assert first.headers() == {
            "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "2",
            "x-ratelimit-limit-tokens": "500", "x-ratelimit-remaining-tokens": "400"}
        await lim.release(first, 30, reached_engine=True)  # 70 unused come back
        second = await take(lim, principal, 200)
        assert isinstance(second, Ticket)
        assert second.headers()["x-ratelimit-remaining-requests"] == "1"
        assert second.headers()["x-ratelimit-remaining-tokens"] == str(500 - 30 - 200)
        assert await take(lim, principal, 10) is not None
        refused = await take(lim, principal, 10)
        assert isinstance(refused, ApiError) and refused.code == "rpm_exceeded"
        assert (refused.headers["x-ratelimit-limit-requests"],
                refused.headers["x-ratelimit-remaining-requests"]) == ("3", "0")
        # Refused a reservation: the limit, but no claim of what is left (some may be).
        beta = Principal(Tenant("beta", tpm=100))
        assert isinstance(await take(lim, beta, 60), Ticket)
        refused = await take(lim, beta, 60)  # 40 left: admitted, then its 60 refused
        assert isinstance(refused, ApiError) and refused.code == "tpm_exceeded"
        assert refused.headers["x-ratelimit-limit-tokens"] == "100"
        assert "x-ratelimit-remaining-tokens" not in refused.headers
        # A tenant without limits gets none of them.
        unlimited = await lim.admit(caller())
        assert unlimited is not None and unlimited.headers() == {}

    run(scenario())


def test_retry_after_is_at_most_a_minute(make_store: Callable[[], StateStore]) -> None:
    # At the start of a second, the oldest bucket leaves in 61 s: said as 60 (what the
    # openai SDK waits for at most), and the retry then is told the second left.
    async def scenario() -> None:
        clock = Clock()
        lim = limiter(make_store(), clock)
        principal = caller(rpm=1)
        clock.at(0.0)
        await lim.release(await lim.admit(principal), 0, reached_engine=True)
        for offset, said in ((0.0, "60"), (60.0, "1")):
            clock.at(offset)
            with pytest.raises(ApiError) as refused:
                await lim.admit(principal)
            assert refused.value.headers["Retry-After"] == said
            assert refused.value.message.endswith(f"retry in {said}s")
        clock.at(61.0)
        await lim.admit(principal)

    run(scenario())


def test_rpm_is_a_sliding_window_too(make_store: Callable[[], StateStore]) -> None:
    async def scenario() -> None:
        clock = Clock()
        lim = limiter(make_store(), clock)
        principal = caller(rpm=2)
        admitted = []
        for offset in (-1.0, -0.5, 0.2, 59.9, 60.0, 60.1):
            clock.at(offset)
            try:
                ticket = await lim.admit(principal)
            except ApiError as exc:
                assert (exc.code, exc.headers["Retry-After"]) == (
                    "rpm_exceeded", str(60 - int(offset // 1)))
                continue
            admitted.append(offset)
            await lim.release(ticket, 0, reached_engine=True)
        assert admitted == [-1.0, -0.5, 60.0, 60.1]

    run(scenario())


def test_store_outage_open_keeps_the_same_limits_locally_closed_answers_503(
        caplog: pytest.LogCaptureFixture) -> None:
    down = f"redis://:secretpw@127.0.0.1:{free_port()}/0"

    async def scenario() -> None:
        clock = Clock().at(3.0)
        principal = caller(tpm=300)
        lim = limiter(RedisStore(down), clock, "open")
        results = [await take(lim, principal, 100) for _ in range(4)]
        assert [isinstance(r, Ticket) for r in results] == [True, True, True, False]
        refused = results[3]
        assert isinstance(refused, ApiError) and refused.code == "tpm_exceeded"
        for ticket in results[:3]:
            assert isinstance(ticket, Ticket)
            await lim.release(ticket, 10, reached_engine=True)
        assert isinstance(await take(lim, principal, 270), Ticket)  # refunds, locally
        closed = limiter(RedisStore(down), clock, "closed")
        with pytest.raises(ApiError) as info:
            await closed.admit(principal)
        assert (info.value.status, info.value.code) == (503, "store_unavailable")
        assert info.value.message == "rate-limit store unavailable; retry later"

    with caplog.at_level(logging.WARNING):
        run(scenario())
    assert "secretpw" not in caplog.text
