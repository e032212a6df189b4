"""Fair shares of the running batch between tenants of one priority.

Without them one request of many sequences (n=128, or a batch of 128 prompts) takes every
one of max_num_seqs slots, and another tenant's request of the same priority waits until
they all end (37 s for a 16-token answer behind n=128 x 200 tokens on a 2-core CPU,
benchmarks/tenant_share.py; 3 s with shares). With
them, a tenant's share is max_num_seqs divided by the tenants that have requests in the
engine (running or waiting):

- admission order: among requests of one priority, those of tenants holding fewer running
  requests go first (arrival order among equals: a stable sort of the queue order);
- a full batch: a waiting request whose tenant holds less than its share takes the slot of
  the newest running request of the tenant holding the most, if that tenant holds more than
  its share and the request is of no higher priority (Scheduler preempts it).

A request's tenant is Request.tenant (the gateway's tenant id, or its caller's address in
open mode); requests without one are one tenant, so a single caller's work is never
preempted for fairness.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence

from engine.request import Request

QueueKey = Callable[[Request], tuple[int, int]]
"""The scheduler's queue order: (priority class, smaller first; arrival number)."""


def fair_order(order: Sequence[Request], running: Sequence[Request], key: QueueKey
               ) -> list[Request]:
    """``order`` with requests of one priority class ordered by how many running requests
    their tenant holds, fewest first; ties keep their order."""
    held = Counter(r.tenant for r in running)
    return sorted(order, key=lambda r: (key(r)[0], held[r.tenant]))


def fair_victim(request: Request, running: Sequence[Request], waiting: Sequence[Request],
                max_num_seqs: int, key: QueueKey, protected: Collection[str]) -> Request | None:
    """The running request to preempt so that ``request`` gets a slot of a full batch (the
    hog's last in queue order: lowest priority, then newest), or None when its tenant holds
    its share already or nobody holds more than theirs. A victim is of the request's
    priority class or a lower one, and not in ``protected`` (request ids)."""
    tenants = {r.tenant for r in running} | {r.tenant for r in waiting} | {request.tenant}
    share = max_num_seqs // len(tenants)
    held = Counter(r.tenant for r in running)
    if held[request.tenant] >= share:
        return None
    hog, most = max(held.items(), key=lambda item: item[1])
    if hog == request.tenant or most <= share:
        return None
    candidates = [r for r in running if r.tenant == hog and key(r)[0] >= key(request)[0]
                  and r.request_id not in protected]
    return max(candidates, key=key) if candidates else None
