"""Scheduler: swap-out and swap-in, refusal of requests larger than the cache, aborts in every
state, and regressions around them. No model: see tests/scheduler_steps.py."""

from __future__ import annotations

import pytest

from engine.request import RequestStatus
from engine.scheduler import Scheduler
from tests.scheduler_steps import (
    TOKEN,
    assert_all_free,
    assert_queues_empty,
    chunks_of,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
    tables_of,
    three_one_block_requests,
)


# ----------------------------------------------------------------------------------- swap
def swap_scenario(num_swap_blocks: int) -> Scheduler:
    """a (8 + 12 tokens) and b (8 + 8 tokens) over 6 blocks of 4: after five steps both
    decode at position 12 and need a fourth block, with none free."""
    sched = make_scheduler(
        6, num_swap_blocks, block_size=4, max_num_batched_tokens=64, preemption_mode="swap"
    )
    sched.add(make_request("a", 8, max_tokens=12, seq=0))
    sched.add(make_request("b", 8, max_tokens=8, seq=1))
    assert tables_of(sched, step(sched)) == {"a": [0, 1], "b": [2, 3]}
    assert tables_of(sched, step(sched)) == {"a": [0, 1, 4], "b": [2, 3, 5]}
    for _ in range(3):
        step(sched)
    assert sched.kv.num_free_blocks == 0
    return sched


def test_swap_out_and_back_in_keeps_progress_and_pairs_exact_blocks() -> None:
    sched = swap_scenario(num_swap_blocks=4)
    kv = sched.kv

    out = step(sched)  # a needs a block: b, the newest, goes to swap space
    assert out.preempted_request_ids == ["b"]
    assert out.blocks_to_swap_out == [(2, 0), (3, 1), (5, 2)]
    assert chunks_of(out) == [("a", 12, 1)]
    assert tables_of(sched, out) == {"a": [0, 1, 4, 5]}  # b's blocks were released as 5, 3, 2
    b = sched.requests["b"]
    assert sched.swapped == [b]
    assert (b.status, b.num_computed_tokens, b.num_tokens) == (RequestStatus.SWAPPED, 12, 13)
    assert kv.swap_pool.num_free == 1

    # b needs 4 device blocks to come back; at most 2 are free until a finishes, which it
    # does in the last of these steps.
    for i in range(6):
        out = step(sched)
        assert chunks_of(out) == [("a", 13 + i, 1)]
        assert tables_of(sched, out) == {"a": [0, 1, 4, 5] if i < 3 else [0, 1, 4, 5, 3]}
        assert out.blocks_to_swap_in == []
        assert sched.swapped == [b]

    out = step(sched)
    assert out.finished_request_ids == ["a"]
    # Free queue: 2, then a's blocks last first (3, 5, 4, 1, 0).
    assert out.blocks_to_swap_in == [(0, 2), (1, 3), (2, 5)]  # (cpu, device)
    assert chunks_of(out) == [("b", 12, 1)]
    assert tables_of(sched, out) == {"b": [2, 3, 5, 4]}
    assert b.status is RequestStatus.RUNNING
    assert b.num_preemptions == 1
    assert kv.swap_pool.num_free == 4

    run_to_completion(sched)
    assert b.output_token_ids == [TOKEN] * 8
    assert_all_free(kv)


def test_swap_falls_back_to_recompute_when_swap_space_is_short() -> None:
    sched = swap_scenario(num_swap_blocks=2)  # b holds 3 blocks

    out = step(sched)
    assert out.preempted_request_ids == ["b"]
    assert out.blocks_to_swap_out == []
    assert sched.swapped == []
    assert [r.request_id for r in sched.waiting] == ["b"]
    b = sched.requests["b"]
    assert (b.status, b.num_computed_tokens) == (RequestStatus.WAITING, 0)
    assert sched.kv.swap_pool.num_free == 2

    run_to_completion(sched)
    assert_all_free(sched.kv)


# ------------------------------------------------------------------------ the whole cache
def test_request_filling_the_whole_cache_runs() -> None:
    # Larger requests are refused before they reach the scheduler (LLMEngine.validate).
    sched = make_scheduler(4, block_size=4, max_num_batched_tokens=64)  # 16 tokens in all
    assert sched.kv.max_tokens_per_request() == 16
    sched.add(make_request("fits", 12, max_tokens=4))  # exactly 16 tokens
    assert [r.request_id for r in sched.waiting] == ["fits"]
    run_to_completion(sched)
    assert_all_free(sched.kv)


# --------------------------------------------------------------------------------- aborts
def test_abort_mid_prefill_frees_blocks() -> None:
    sched = make_scheduler(16, block_size=4, max_num_batched_tokens=16)
    sched.add(make_request("a", 40, seq=0))
    sched.add(make_request("b", 4, seq=1))
    assert chunks_of(step(sched)) == [("a", 0, 16)]

    aborted = sched.abort("a")
    assert aborted is not None
    assert (aborted.status, aborted.finish_reason) == (RequestStatus.FINISHED, "abort")
    assert sched.kv.block_table("a") == []
    assert sched.kv.num_free_blocks == 16

    out = step(sched)
    assert out.finished_request_ids == ["a"]
    assert chunks_of(out) == [("b", 0, 4)]
    run_to_completion(sched)
    assert_all_free(sched.kv)


def test_abort_mid_decode_and_between_schedule_and_update() -> None:
    sched = make_scheduler(16, block_size=4, max_num_batched_tokens=64)
    sched.add(make_request("a", 6, max_tokens=8, seq=0))
    sched.add(make_request("b", 6, max_tokens=8, seq=1))
    step(sched)
    step(sched)
    assert sched.requests["a"].num_computed_tokens == 7

    assert sched.abort("a") is not None
    out = sched.schedule()
    assert out.finished_request_ids == ["a"]
    assert chunks_of(out) == [("b", 7, 1)]
    assert sched.abort("b") is not None  # the engine's abort can land mid-step
    assert sched.update(out, {"b": TOKEN}) == []
    assert sched.abort("b") is None
    assert_queues_empty(sched)
    assert_all_free(sched.kv)


def test_abort_waiting_requests_fresh_and_after_recompute() -> None:
    sched = three_one_block_requests("fcfs", (0, 0, 0))
    sched.add(make_request("fresh", 4, seq=3))
    out = step(sched)
    assert out.preempted_request_ids == ["c"]
    assert [r.request_id for r in sched.waiting] == ["c", "fresh"]

    assert sched.abort("c") is not None
    assert sched.abort("fresh") is not None
    assert sched.waiting == []
    assert sched.schedule().finished_request_ids == ["c", "fresh"]
    sched.abort("a")
    sched.abort("b")
    assert_queues_empty(sched)
    assert_all_free(sched.kv)


def test_abort_swapped_request_frees_swap_blocks() -> None:
    sched = swap_scenario(num_swap_blocks=4)
    step(sched)
    assert [r.request_id for r in sched.swapped] == ["b"]
    assert sched.kv.swap_pool.num_free == 1

    assert sched.abort("b") is not None
    assert sched.swapped == []
    assert sched.kv.swap_pool.num_free == 4
    run_to_completion(sched)
    assert_all_free(sched.kv)


def test_finish_for_an_outside_reason_frees_blocks() -> None:
    sched = make_scheduler(8, block_size=4, max_num_batched_tokens=64)
    sched.add(make_request("a", 6, max_tokens=8))
    step(sched)
    sched.finish("a", "stop")
    sched.finish("unknown", "stop")
    assert sched.schedule().finished_request_ids == ["a"]
    assert_queues_empty(sched)
    assert_all_free(sched.kv)


# ------------------------------------------------------------------- regressions (swap, config)
def test_swap_in_after_preemption_of_a_scheduled_prefill_chunk() -> None:
    sched = make_scheduler(
        10, 20, block_size=4, max_num_batched_tokens=13, long_prefill_token_threshold=8,
        preemption_mode="swap", scheduling_policy="priority",
    )
    sched.add(make_request("low", 33, max_tokens=3, seq=0, priority=0))
    step(sched)
    sched.add(make_request("mid", 7, max_tokens=2, seq=1, priority=1))
    step(sched)
    sched.add(make_request("high", 16, max_tokens=3, seq=2, priority=2))
    step(sched)

    out = step(sched)  # low's 24..31 chunk got blocks 8, 9, then high preempts low
    assert out.preempted_request_ids == ["low"]
    assert sched.requests["low"].num_computed_tokens == 24
    # Only the 6 blocks holding computed KV go to swap space, not the 2 of the dropped chunk.
    assert len(out.blocks_to_swap_out) == 6

    run_to_completion(sched)
    assert_all_free(sched.kv)


def test_no_device_block_is_swapped_in_and_out_in_the_same_step() -> None:
    sched = make_scheduler(
        4, 8, block_size=4, max_num_batched_tokens=64, preemption_mode="swap",
        scheduling_policy="priority",
    )
    sched.add(make_request("low", 4, max_tokens=8, seq=0, priority=0))
    sched.add(make_request("mid", 8, max_tokens=2, seq=1, priority=1))
    step(sched)
    out = step(sched)
    assert out.preempted_request_ids == ["low"]
    assert out.blocks_to_swap_out == [(2, 0)]

    sched.add(make_request("high", 12, max_tokens=4, seq=2, priority=1))
    out = step(sched)
    swapped_in = {device for _, device in out.blocks_to_swap_in}
    swapped_out = {device for device, _ in out.blocks_to_swap_out}
    assert swapped_in.isdisjoint(swapped_out), (out.blocks_to_swap_in, out.blocks_to_swap_out)


def test_threshold_without_chunked_prefill_is_refused() -> None:
    # Without chunks a prompt capped by the threshold could never be scheduled.
    with pytest.raises(ValueError, match="long_prefill_token_threshold needs"):
        make_scheduler(32, block_size=16, max_num_batched_tokens=64,
                       long_prefill_token_threshold=16, enable_chunked_prefill=False)
