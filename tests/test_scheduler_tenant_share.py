"""Tenants of one priority share the running batch: a request of a tenant holding less than
its share takes the newest slot of the tenant holding the most (engine/tenant_share.py);
one caller's own work, or work of a higher priority, is never preempted for it."""

from __future__ import annotations

import pytest

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from tests.scheduler_steps import (
    assert_all_free,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def tenant_request(request_id: str, tenant: str | None, seq: int, priority: int = 0
                   ) -> Request:
    request = make_request(request_id, 4, max_tokens=50, seq=seq, priority=priority)
    request.tenant = tenant
    return request


def full_batch(policy: str = "priority", tenant: str | None = "hog") -> Scheduler:
    """Four slots, all held by one tenant's requests h0-h3 (h4, h5 wait)."""
    sched = make_scheduler(64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                           scheduling_policy=policy)
    for i in range(6):
        sched.add(tenant_request(f"h{i}", tenant, seq=i))
    step(sched)
    assert [r.request_id for r in sched.running] == ["h0", "h1", "h2", "h3"]
    return sched


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_another_tenant_gets_a_slot_of_a_full_batch_at_once(policy: str) -> None:
    sched = full_batch(policy)
    sched.add(tenant_request("v", "victim", seq=6))
    out = step(sched)
    assert out.preempted_request_ids == ["h3"]  # the hog's newest running request
    assert [r.request_id for r in sched.running] == ["h0", "h1", "h2", "v"]
    assert sched.requests["h3"].status is RequestStatus.WAITING
    # Share 2 each (two tenants, 4 slots): the hog keeps its 3 while the victim needs no
    # more; a second victim request takes another of its slots.
    sched.add(tenant_request("v2", "victim", seq=7))
    out = step(sched)
    assert out.preempted_request_ids == ["h2"]
    assert sorted(r.request_id for r in sched.running) == ["h0", "h1", "v", "v2"]
    run_to_completion(sched)
    assert_all_free(sched.kv)


def test_a_freed_slot_goes_to_the_tenant_holding_fewer() -> None:
    sched = full_batch()
    sched.add(tenant_request("v", "victim", seq=6))
    sched.add(tenant_request("w", "third", seq=7))
    step(sched)  # share 1 each of 3 tenants (4 // 3): the hog gives up h3, then h2
    assert sorted(r.request_id for r in sched.running) == ["h0", "h1", "v", "w"]
    sched.add(tenant_request("w2", "third", seq=8))
    sched.abort("v")
    out = step(sched)  # the hog's h2-h5 waited longer, but it holds 2 and "third" 1
    assert out.preempted_request_ids == []
    assert sorted(r.request_id for r in sched.running) == ["h0", "h1", "w", "w2"]


def test_one_caller_s_own_work_is_never_preempted_for_fairness() -> None:
    sched = full_batch(tenant=None)
    sched.add(tenant_request("late", None, seq=6))
    out = step(sched)
    assert out.preempted_request_ids == []
    assert [r.request_id for r in sched.waiting] == ["h4", "h5", "late"]


def test_a_lower_priority_request_takes_no_slot_of_a_higher_priority() -> None:
    sched = make_scheduler(64, block_size=4, max_num_batched_tokens=64, max_num_seqs=2,
                           scheduling_policy="priority")
    for i in range(2):
        sched.add(tenant_request(f"vip{i}", "vip", seq=i, priority=1))
    step(sched)
    sched.add(tenant_request("low", "other", seq=2, priority=0))
    out = step(sched)
    assert out.preempted_request_ids == []
    assert [r.request_id for r in sched.waiting] == ["low"]
