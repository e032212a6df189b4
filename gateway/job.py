"""A generation as the gateway carries it (Job) and its tenant's hold on the limits (Claim),
from admission to the end of its stream."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from engine.protocol import GenerateRequest
from gateway.auth import Principal
from gateway.cache_key_affinity import AffinityKey
from gateway.ratelimit import Ticket
from gateway.router import RoutingDecision

Outcome = Literal["served", "refused", "failed"]
"""How a claim ends: "served" (reached an engine: charge its tokens), "refused" (the client's
own error: the request still counts, no tokens), "failed" (the gateway could not serve it:
refunded)."""


@dataclass
class Claim:
    """An admitted request's hold on its tenant's limits, from admission (before any
    expensive work) to its end; settled exactly once, whatever the outcome."""

    ticket: Ticket | None
    admission_share: float
    """Fraction of an instance's admission bound the request may use: lower tiers are shed
    first when instances fill up."""
    settled: bool = False


def new_request_id() -> str:
    return f"gw-{uuid.uuid4().hex}"


@dataclass
class Job:
    """One generation as the gateway dispatches it: the engine request and what the gateway
    keeps about it."""

    request: GenerateRequest
    endpoint: str
    claim: Claim
    arrival: float = field(default_factory=time.monotonic)
    instance_id: str | None = None
    decision: RoutingDecision | None = None
    first_token_at: float | None = None
    """time.monotonic() when the first token reached the gateway (the access log's TTFT)."""
    prefer: str | None = None
    """An instance to try first (another sequence of the same prompt runs there)."""
    cache_key: AffinityKey | None = None
    """Its prompt_cache_key, scoped to the requests it can share cache blocks with."""
    whole: bool = False
    """Answered as one response (not streamed): its chunks are held until the last, so an
    engine that dies mid-response is invisible to the client and the job starts over
    elsewhere."""
    held_tokens: int = 0
    """A whole response's tokens generated so far on its current engine (held, not yet
    formatted): what its tenant is charged if the client leaves before the end."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def adapter(self) -> str | None:
        return self.request.adapter


def tier_share(principal: Principal) -> float:
    """Share of the admission bound by tenant tier: tiers below 0 get 75%, tier 0 90%,
    higher tiers (and the operator) all of it, so the lowest tier hits 429 first."""
    if principal.tenant is None or principal.tenant.priority > 0:
        return 1.0
    return 0.9 if principal.tenant.priority == 0 else 0.75
