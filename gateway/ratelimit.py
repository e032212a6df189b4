"""Per-tenant RPM / TPM limits and concurrency, enforced before a request is routed.

A request passes three steps, each one atomic operation of the store (gateway/store.py):
- admit(), before the prompt is tokenized: the key is still valid, the tenant's sliding
  minute still has a request and a token left (cheap refusals before expensive work);
  counts the request;
- reserve(ticket, prompt_tokens + max_tokens), once tokenized: takes the most the request
  can use from the tenant's sliding TPM window, or refuses (a burst of concurrent requests
  can never overrun the limit, because each holds its tokens before it runs);
- release(ticket, tokens_used, reached_engine), when it ends: gives back what it did not
  use (all of it, and the request, if it never reached an engine).
The windows slide over per-second buckets (gateway/sliding_window.py): no 60 s interval
serves more than rpm requests or tpm tokens, however requests straddle a minute boundary.
Over a limit is a 429 with Retry-After (seconds until enough of the window is free) and a
body naming the limit; a request whose prompt + max_tokens exceeds the whole tpm is a 429
that says it can never fit, without Retry-After. Max concurrency is counted by each gateway
for its own requests.

When the store is down (StoreUnavailable), ``failure_policy`` decides:
- "open" (default): keep serving, with the same limits counted in this process's memory
  (so N replicas together may admit up to N x the limit while the outage lasts); the
  gateway_store_unavailable counter shows every request decided this way;
- "closed": refuse with 503 until the store is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter

from engine.http.errors import ApiError
from gateway import sliding_window as sw
from gateway.auth import Principal
from gateway.store import Admission, MemoryStore, StateStore, StoreUnavailable
from gateway.tenancy import Tenant

log = logging.getLogger(__name__)
NEVER_RETRY = {"x-should-retry": "false"}
"""On a refusal that waiting never changes: the openai SDK (and the clients built on it)
retries a 429 unless this header says not to, and each retry costs the tenant a request."""
FailurePolicy = Literal["open", "closed"]
T = TypeVar("T")


@dataclass
class Ticket:
    """An admitted request's claim on its tenant's limits."""

    principal: Principal
    second: int
    """The bucket its request was counted in."""
    store: StateStore
    """Where the request was counted (the shared store, or the local fallback)."""
    reserved: int = 0
    """Tokens reserve() took for it."""
    reserved_second: int = 0
    token_store: StateStore | None = None
    """Where reserve() took them (None: not yet)."""
    released: bool = False
    requests_used: int | None = None
    tokens_used: int | None = None
    """The tenant's window as the store last told it (Admission's fields)."""

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-limit-* and x-ratelimit-remaining-* headers for the
        tenant's limits, as of this request's admission (and token reservation)."""
        tenant = self.principal.tenant
        assert tenant is not None
        return {**_window_headers("requests", tenant.rpm, self.requests_used),
                **_window_headers("tokens", tenant.tpm, self.tokens_used)}


def _window_headers(unit: str, limit: int | None, used: int | None) -> dict[str, str]:
    """The limit, and what is left of it when ``used`` is known."""
    if limit is None:
        return {}
    left = {} if used is None else {f"x-ratelimit-remaining-{unit}": str(max(0, limit - used))}
    return {f"x-ratelimit-limit-{unit}": str(limit), **left}


def counted_as(tenant: Tenant) -> str:
    """The name a tenant's limits are counted under (its sliding windows in the store, its
    requests in flight here): one incarnation's, so a tenant deleted and created again under
    its id starts with empty windows and nothing in flight, while the requests of the old
    one still settle against the old one's counters."""
    return f"{tenant.tenant_id}:{tenant.uid}" if tenant.uid else tenant.tenant_id


class RateLimiter:
    """Admits requests against their tenant's limits (see the module docstring).

    ``clock`` gives unix seconds (injectable: tests replay bursts at chosen instants)."""

    def __init__(self, store: StateStore, registry: CollectorRegistry,
                 failure_policy: FailurePolicy = "open",
                 clock: Callable[[], float] = time.time) -> None:
        if failure_policy not in ("open", "closed"):
            raise ValueError(f"store failure policy must be 'open' or 'closed', got "
                             f"{failure_policy!r}")
        self.store = store
        self.fallback = MemoryStore()
        self.failure_policy = failure_policy
        self.clock = clock
        self._in_flight: dict[str, int] = {}
        self._store_down = False
        self.rejections = Counter("loragate_gateway_rate_limited",
                                  "Requests refused by a tenant limit", ["limit"],
                                  registry=registry)
        self.store_unavailable = Counter(
            "loragate_gateway_store_unavailable",
            "Requests admitted or refused by the store-failure policy (store unreachable)",
            ["policy"], registry=registry)

    async def admit(self, principal: Principal) -> Ticket | None:
        """A ticket, None for the open mode (no limits), or ApiError 429 / 401 / 503."""
        tenant = principal.tenant
        if tenant is None:
            return None
        counted = counted_as(tenant)
        in_flight = self._in_flight.get(counted, 0)
        if tenant.max_concurrency is not None and in_flight >= tenant.max_concurrency:
            self.rejections.labels("concurrency").inc()
            raise ApiError(429, f"tenant {tenant.tenant_id} has {in_flight} requests in "
                           f"flight, its max_concurrency is {tenant.max_concurrency}",
                           code="concurrency_limit_exceeded", headers={"Retry-After": "1"})
        # The slot is held across the store's round trip below: a burst that arrives while
        # it is under way sees it taken (counted after it, all of a burst got in).
        self._in_flight[counted] = in_flight + 1
        try:
            now = self.clock()
            store, admission = await self._decide(self.store, lambda s: s.admit(
                # The fallback cannot check revocation: it knows no keys.
                principal.key_hash if s is self.store else None, counted,
                tenant.rpm, tenant.tpm, now))
            if not admission.allowed:
                if admission.reason == "revoked":
                    raise ApiError(401, "invalid API key", code="invalid_api_key")
                raise self._refusal(tenant, admission)
        except BaseException:
            self._free_slot(counted)
            raise
        return Ticket(principal, admission.second, store,
                      requests_used=admission.requests_used, tokens_used=admission.tokens_used)

    async def reserve(self, ticket: Ticket | None, tokens: int, *,
                      prompt_tokens: int | None = None) -> None:
        """Claim ``tokens`` (prompt + max_tokens) of the tenant's TPM for an admitted request,
        after it was tokenized; ApiError 429 when the tenant's token budget cannot hold
        them now (or ever), 503 under the closed policy while the store is down. Call at
        most once per ticket; release() later refunds what the request did not use.

        ``prompt_tokens``: given for a request that set no max_tokens (``tokens`` then
        holds a reserve for its output, not a bound the client chose): the reserve shrinks
        to what the TPM leaves beside the prompt, so only a prompt the limit cannot hold
        is refused as never fitting (what the output uses beyond is charged at release)."""
        if ticket is None or tokens <= 0:
            return
        tenant = ticket.principal.tenant
        assert tenant is not None and not ticket.released and ticket.token_store is None
        if tenant.tpm is None:
            return
        tpm: int = tenant.tpm
        if prompt_tokens is not None:
            tokens = min(tokens, max(prompt_tokens + 1, tpm))
        if tokens > tpm:
            self.rejections.labels("tpm").inc()
            need, fix = (f"its prompt and one token of output come to {tokens} tokens",
                         "shorten the prompt") if prompt_tokens is not None else (
                f"its prompt plus max_tokens come to {tokens} tokens",
                "lower max_tokens or shorten the prompt")
            raise ApiError(429, f"this request can never fit tenant {tenant.tenant_id}'s "
                           f"token limit: {need}, and the tenant may use {tpm} tokens per "
                           f"minute; {fix}", code="tpm_exceeded",
                           param="max_tokens" if prompt_tokens is None else None,
                           headers=dict(NEVER_RETRY))
        now = self.clock()
        store, admission = await self._decide(ticket.store, lambda s: s.reserve(
            counted_as(tenant), tokens, tpm, now))
        if not admission.allowed:
            raise self._refusal(tenant, admission, tokens)
        ticket.reserved, ticket.reserved_second, ticket.token_store = (
            tokens, admission.second, store)
        ticket.tokens_used = admission.tokens_used

    async def release(self, ticket: Ticket | None, tokens: int, reached_engine: bool) -> None:
        """End a ticket: settle its tokens (``tokens`` used: refund the rest of the
        reservation, charge any excess), or refund everything if it never reached an
        engine. Once per ticket (later calls do nothing)."""
        if ticket is None or ticket.released:
            return
        ticket.released = True
        tenant = ticket.principal.tenant
        assert tenant is not None
        counted = counted_as(tenant)
        self._free_slot(counted)
        now = self.clock()
        token_store = ticket.token_store or ticket.store
        try:
            if not reached_engine:
                await ticket.store.refund(counted, ticket.second, now)
                tokens = 0
            extra = tokens - ticket.reserved
            if extra < 0:  # give back the unused part, where it was taken
                await token_store.charge(counted, extra, ticket.reserved_second, now)
            elif extra > 0 and tenant.tpm is not None:  # used more than it reserved
                await token_store.charge(counted, extra, sw.second_of(now), now)
        except StoreUnavailable as exc:
            self.store_unavailable.labels(self.failure_policy).inc()
            log.warning("could not settle the tokens of tenant %s: %s", tenant.tenant_id, exc)

    def _free_slot(self, counted: str) -> None:
        left = self._in_flight[counted] - 1
        if left:
            self._in_flight[counted] = left
        else:  # no entry per incarnation ever seen
            del self._in_flight[counted]

    async def _decide(self, store: StateStore, op: Callable[[StateStore], Awaitable[T]]
                      ) -> tuple[StateStore, T]:
        """op on ``store``; if that is the shared store and it is down, the failure policy:
        503 (closed) or op on the local fallback (open)."""
        try:
            result = await op(store)
        except StoreUnavailable as exc:
            if store is not self.store:
                raise
            self.store_unavailable.labels(self.failure_policy).inc()
            if not self._store_down:
                log.warning("rate-limit store unavailable (policy %s): %s",
                            self.failure_policy, exc)
            self._store_down = True
            if self.failure_policy == "closed":
                # Generic on purpose: the store's address is none of the tenant's business.
                raise ApiError(503, "rate-limit store unavailable; retry later",
                               code="store_unavailable", headers={"Retry-After": "1"}) from None
            return self.fallback, await op(self.fallback)
        if store is self.store and self._store_down:
            log.warning("rate-limit store reachable again")
            self._store_down = False
        return store, result

    def _refusal(self, tenant: Tenant, admission: Admission, tokens: int = 0) -> ApiError:
        limit = tenant.rpm if admission.reason == "rpm" else tenant.tpm
        unit = "requests" if admission.reason == "rpm" else "tokens"
        need = f"; this request needs {tokens} (prompt + max_tokens)" if tokens else ""
        self.rejections.labels(admission.reason or "").inc()
        # The sliding window's last second can make the wait 61 s; the openai SDK honours a
        # Retry-After of at most 60 and otherwise retries at once, spending its retries
        # while still refused. Said as 60, a retry is at most one second early, and its 429
        # says "1".
        retry = min(admission.retry_after_s, sw.WINDOW_S)
        return ApiError(429, f"rate limit exceeded: {admission.reason} (tenant "
                        f"{tenant.tenant_id} may use {limit} {unit} per minute{need}); retry "
                        f"in {retry}s", code=f"{admission.reason}_exceeded",
                        headers={"Retry-After": str(retry),
                                 # Refused at admission, the window is full; refused a
                                 # reservation, some may be left, but not what it needs.
                                 **_window_headers(unit, limit, None if tokens else limit)})
