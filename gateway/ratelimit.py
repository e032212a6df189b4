"""Per-tenant RPM / TPM limits and concurrency, enforced before a request is routed.

admit() makes the store's one atomic check (see gateway/store.py); over a limit is a 429 with
Retry-After and a body naming the limit. A request that then fails before reaching an engine
(no capacity, no instance) is refunded; tokens (prompt + completion) are charged when it
ends. Max concurrency is counted by each gateway for its own requests.

When the store is down (StoreUnavailable), ``failure_policy`` decides:
- "open" (default): keep serving, with the same limits counted in this process's memory
  (so N replicas together may admit up to N x the limit while the outage lasts); the
  gateway_store_unavailable counter shows every request decided this way;
- "closed": refuse with 503 until the store is back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter

from engine.http_errors import ApiError
from gateway.auth import Principal
from gateway.store import MemoryStore, StateStore, StoreUnavailable

log = logging.getLogger(__name__)
FailurePolicy = Literal["open", "closed"]


@dataclass
class Ticket:
    """An admitted request's claim on its tenant's limits."""

    principal: Principal
    window: int
    store: StateStore
    """Where it was counted (the shared store, or the local fallback)."""
    released: bool = False


class RateLimiter:
    """Admits requests against their tenant's limits (see the module docstring)."""

    def __init__(self, store: StateStore, registry: CollectorRegistry,
                 failure_policy: FailurePolicy = "open") -> None:
        if failure_policy not in ("open", "closed"):
            raise ValueError(f"store failure policy must be 'open' or 'closed', got "
                             f"{failure_policy!r}")
        self.store = store
        self.fallback = MemoryStore()
        self.failure_policy = failure_policy
        self._in_flight: dict[str, int] = {}
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
        if tenant.max_concurrency is not None and \
                self._in_flight.get(tenant.tenant_id, 0) >= tenant.max_concurrency:
            self.rejections.labels("concurrency").inc()
            raise ApiError(429, f"tenant {tenant.tenant_id} has {tenant.max_concurrency} "
                           f"requests in flight (its max_concurrency)",
                           code="concurrency_limit_exceeded", headers={"Retry-After": "1"})
        store = self.store
        try:
            admission = await store.admit(principal.key_hash, tenant.tenant_id, tenant.rpm,
                                          tenant.tpm)
        except StoreUnavailable as exc:
            self.store_unavailable.labels(self.failure_policy).inc()
            if self.failure_policy == "closed":
                raise ApiError(503, f"rate-limit store unavailable: {exc}",
                               code="store_unavailable", headers={"Retry-After": "1"}) from None
            store = self.fallback
            admission = await store.admit(None, tenant.tenant_id, tenant.rpm, tenant.tpm)
        if not admission.allowed:
            if admission.reason == "revoked":
                raise ApiError(401, "invalid API key", code="invalid_api_key")
            limit = tenant.rpm if admission.reason == "rpm" else tenant.tpm
            unit = "requests" if admission.reason == "rpm" else "tokens"
            self.rejections.labels(admission.reason or "").inc()
            raise ApiError(429, f"rate limit exceeded: {admission.reason} (tenant "
                           f"{tenant.tenant_id} may use {limit} {unit} per minute); retry "
                           f"in {admission.retry_after_s}s", code=f"{admission.reason}_exceeded",
                           headers={"Retry-After": str(admission.retry_after_s)})
        self._in_flight[tenant.tenant_id] = self._in_flight.get(tenant.tenant_id, 0) + 1
        return Ticket(principal, admission.window, store)

    async def reserve(self, ticket: Ticket | None, tokens: int) -> None:
        """Claim ``tokens`` (prompt + max_tokens) of the tenant's TPM for an admitted request,
        after it was tokenized; ApiError 429 when the tenant's token budget cannot hold
        them now. release() later refunds what the request did not use."""
        return None

    async def release(self, ticket: Ticket | None, tokens: int, reached_engine: bool) -> None:
        """End a ticket: charge its tokens, or refund it if it never reached an engine."""
        if ticket is None or ticket.released:
            return
        ticket.released = True
        tenant = ticket.principal.tenant
        assert tenant is not None
        self._in_flight[tenant.tenant_id] -= 1
        try:
            if not reached_engine:
                await ticket.store.refund(tenant.tenant_id, ticket.window)
            elif tokens:
                await ticket.store.charge(tenant.tenant_id, tokens, ticket.window)
        except StoreUnavailable as exc:
            self.store_unavailable.labels(self.failure_policy).inc()
            log.warning("could not settle tokens of tenant %s: %s", tenant.tenant_id, exc)
