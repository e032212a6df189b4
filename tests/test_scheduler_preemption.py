"""Scheduler: preemption by recompute (fcfs and priority) and admission order. No model: see
tests/scheduler_steps.py."""

from __future__ import annotations

import pytest

from engine.request import RequestStatus
from engine.scheduler import Scheduler
from tests.scheduler_steps import (
    assert_all_free,
    chunks_of,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
    tables_of,
    three_one_block_requests,
)


# ----------------------------------------------------------------------------- preemption
def assert_recomputed(sched: Scheduler, request_id: str) -> None:
    victim = sched.requests[request_id]
    assert victim.status is RequestStatus.WAITING
    assert victim in sched.waiting
    assert victim.num_computed_tokens == 0
    assert victim.num_tokens == 5  # keeps its sampled token: recompute covers prompt + output
    assert victim.num_preemptions == 1
    assert sched.kv.block_table(request_id) == []


def test_fcfs_preempts_newest_running_request_by_recompute() -> None:
    sched = three_one_block_requests("fcfs", (0, 0, 0))
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]

    out = step(sched)
    assert out.preempted_request_ids == ["c"]
    assert chunks_of(out) == [("a", 4, 1), ("b", 4, 1)]
    assert tables_of(sched, out) == {"a": [0, 3], "b": [1, 2]}
    assert out.blocks_to_swap_out == []
    assert sched.num_preemptions == 1
    assert_recomputed(sched, "c")

    run_to_completion(sched)
    assert_all_free(sched.kv)


def test_priority_preempts_lowest_priority_running_request() -> None:
    # Admission: a (1), c (1), b (0). a grows, then c finds no block: b is the victim although
    # c is newer, and c takes b's block.
    sched = three_one_block_requests("priority", (1, 0, 1))
    assert [r.request_id for r in sched.running] == ["a", "c", "b"]

    out = step(sched)
    assert out.preempted_request_ids == ["b"]
    assert chunks_of(out) == [("a", 4, 1), ("c", 4, 1)]
    assert tables_of(sched, out) == {"a": [0, 3], "c": [1, 2]}
    assert_recomputed(sched, "b")

    run_to_completion(sched)
    assert_all_free(sched.kv)


def test_priority_breaks_ties_by_preempting_newest() -> None:
    # Admission: c (1), a (0), b (0). c grows, a finds no block: among the priority-0 requests
    # the newest, b, is the victim.
    sched = three_one_block_requests("priority", (0, 0, 1))
    assert [r.request_id for r in sched.running] == ["c", "a", "b"]

    out = step(sched)
    assert out.preempted_request_ids == ["b"]
    assert chunks_of(out) == [("c", 4, 1), ("a", 4, 1)]
    assert_recomputed(sched, "b")

    run_to_completion(sched)
    assert_all_free(sched.kv)


def test_victim_already_scheduled_this_step_loses_its_chunk() -> None:
    # low was admitted before high, so it is scheduled first; then high finds no block and
    # low, the lower priority, is preempted after its decode was already in the batch.
    sched = make_scheduler(3, block_size=4, max_num_batched_tokens=64, scheduling_policy="priority")
    sched.add(make_request("low", 4, max_tokens=8, seq=0, priority=0))
    step(sched)
    sched.add(make_request("high", 4, max_tokens=8, seq=1, priority=1))
    assert tables_of(sched, step(sched)) == {"low": [0, 1], "high": [2]}

    out = step(sched)  # low decodes at 5 (no new block), high at 4 needs one
    assert out.preempted_request_ids == ["low"]
    assert chunks_of(out) == [("high", 4, 1)]
    assert out.num_batched_tokens == 1
    assert tables_of(sched, out) == {"high": [2, 1]}  # low released [1, 0], last block first
    low = sched.requests["low"]
    assert (low.status, low.num_computed_tokens, low.num_tokens) == (RequestStatus.WAITING, 0, 6)
    run_to_completion(sched)
    assert_all_free(sched.kv)


# --------------------------------------------------------------------------- admission order
@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", ["a", "b", "c", "d"]), ("priority", ["b", "d", "c", "a"])],
)
def test_waiting_admission_order(policy: str, expected: list[str]) -> None:
    sched = make_scheduler(32, block_size=4, max_num_batched_tokens=64, scheduling_policy=policy)
    for i, (rid, priority) in enumerate(zip("abcd", (0, 2, 1, 2), strict=True)):
        sched.add(make_request(rid, 4, seq=i, priority=priority))
    out = step(sched)
    assert [c.request_id for c in out.chunks] == expected
    assert [r.request_id for r in sched.running] == expected


def test_priority_admission_under_max_num_seqs_one() -> None:
    sched = make_scheduler(
        32, block_size=4, max_num_batched_tokens=64, max_num_seqs=1, scheduling_policy="priority"
    )
    for i, (rid, priority) in enumerate(zip("abc", (0, 5, 1), strict=True)):
        sched.add(make_request(rid, 4, max_tokens=1, seq=i, priority=priority))
    order = [[c.request_id for c in step(sched).chunks] for _ in range(3)]
    assert order == [["b"], ["c"], ["a"]]
    assert_all_free(sched.kv)


def hold_all_blocks(policy: str) -> Scheduler:
    """low (priority 0) fills 3 of 4 blocks; its next decode takes the last one."""
    sched = make_scheduler(4, block_size=4, max_num_batched_tokens=64, scheduling_policy=policy)
    sched.add(make_request("low", 12, max_tokens=4, seq=0, priority=0))
    step(sched)
    return sched


def test_higher_priority_waiting_request_preempts_lower_priority_running() -> None:
    sched = hold_all_blocks("priority")
    sched.add(make_request("high", 8, max_tokens=2, seq=1, priority=1))

    out = step(sched)
    assert out.preempted_request_ids == ["low"]
    assert chunks_of(out) == [("high", 0, 8)]
    assert tables_of(sched, out) == {"high": [3, 2]}  # low released last block first
    low = sched.requests["low"]
    assert (low.status, low.num_computed_tokens) == (RequestStatus.WAITING, 0)
    assert [r.request_id for r in sched.waiting] == ["low"]

    run_to_completion(sched)
    assert_all_free(sched.kv)


@pytest.mark.parametrize(("policy", "priority"), [("priority", 0), ("fcfs", 1)])
def test_waiting_request_does_not_preempt_equal_priority_or_under_fcfs(
    policy: str, priority: int
) -> None:
    sched = hold_all_blocks(policy)
    sched.add(make_request("new", 8, max_tokens=2, seq=1, priority=priority))

    out = step(sched)
    assert out.preempted_request_ids == []
    assert chunks_of(out) == [("low", 12, 1)]
    assert [r.request_id for r in sched.waiting] == ["new"]
    run_to_completion(sched)
    assert_all_free(sched.kv)
