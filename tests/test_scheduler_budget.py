"""Scheduler: the token budget, block-aligned prefill chunks, max_num_seqs and decode-first
ordering. No model: see tests/scheduler_steps.py."""

from __future__ import annotations

import random

import pytest

from engine.kv_cache import blocks_for
from tests.scheduler_steps import (
    TOKEN,
    assert_all_free,
    assert_queues_empty,
    assert_runner_in_sync,
    chunks_of,
    feed_runner,
    make_request,
    make_scheduler,
    run_to_completion,
    runner_copy,
    step,
    tables_of,
)


# --------------------------------------------------------------------- budget and chunks
def test_budget_split_cuts_second_prompt_on_block_boundary() -> None:
    sched = make_scheduler(32, block_size=16, max_num_batched_tokens=64)
    sched.add(make_request("a", 40, max_tokens=2, seq=0))
    sched.add(make_request("b", 50, max_tokens=2, seq=1))

    out = step(sched)  # 40 + 16 = 56 <= 64 < 40 + 32
    assert chunks_of(out) == [("a", 0, 40), ("b", 0, 16)]
    assert [c.sample for c in out.chunks] == [True, False]
    assert tables_of(sched, out) == {"a": [0, 1, 2], "b": [3]}
    assert out.num_batched_tokens == 56

    out = step(sched)  # a decodes, b finishes its prompt
    assert chunks_of(out) == [("a", 40, 1), ("b", 16, 34)]
    assert [c.sample for c in out.chunks] == [True, True]
    assert tables_of(sched, out) == {"a": [0, 1, 2], "b": [3, 4, 5, 6]}
    # Both are known to the runner by now: a decode and a chunk are deltas without tokens.
    assert out.new_requests == [] and [c.new_block_ids for c in out.chunks] == [[], [4, 5, 6]]
    assert runner_copy(sched).requests["a"].token_ids == list(range(40)) + [TOKEN, TOKEN]

    out = step(sched)
    assert out.finished_request_ids == ["a"]
    assert chunks_of(out) == [("b", 50, 1)]
    step(sched)
    assert_queues_empty(sched)
    assert_all_free(sched.kv)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_workload_keeps_chunks_block_aligned_and_within_limits(
    policy: str, mode: str
) -> None:
    rng = random.Random(1234)
    bs, budget, max_seqs, threshold = 8, 48, 5, 24
    sched = make_scheduler(
        24, 64, block_size=bs, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
        long_prefill_token_threshold=threshold, scheduling_policy=policy, preemption_mode=mode,
    )
    kv = sched.kv
    num_requests, added, steps = 40, 0, 0
    while added < num_requests or sched.has_unfinished():
        steps += 1
        assert steps < 5000, "scheduler made no progress"
        while added < num_requests and rng.random() < 0.5:
            sched.add(make_request(
                f"r{added}", rng.randint(1, 120), max_tokens=rng.randint(1, 30),
                seq=added, priority=rng.randint(0, 3),
            ))
            added += 1
        out = sched.schedule()

        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= max_seqs
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        for c in out.chunks:
            request = sched.requests[c.request_id]
            assert c.context_len <= request.num_tokens
            assert c.sample == (c.context_len == request.num_tokens)
            if not c.sample:  # every unfinished chunk fills whole blocks
                assert c.start_pos % bs == 0
                assert c.context_len % bs == 0
            if c.num_tokens > 1:
                assert c.num_tokens <= threshold
        feed_runner(sched, out)  # asserts every chunk is covered by the runner's table
        for c in out.chunks:
            assert len(runner_copy(sched).block_table(c.request_id)) == blocks_for(
                c.context_len, bs)
        owned = [b for r in sched.running for b in kv.block_table(r.request_id)]
        assert len(owned) == len(set(owned))
        assert len(owned) + kv.num_free_blocks == kv.num_blocks

        sched.update(out, {c.request_id: TOKEN for c in out.chunks if c.sample})
        assert_runner_in_sync(sched)
    assert_queues_empty(sched)
    assert_all_free(kv)


def test_long_prefill_threshold_caps_one_request_per_step_block_aligned() -> None:
    sched = make_scheduler(
        32, block_size=16, max_num_batched_tokens=64, long_prefill_token_threshold=40
    )
    sched.add(make_request("long", 110, max_tokens=1, seq=0))
    sched.add(make_request("short", 20, max_tokens=3, seq=1))

    # The cap of 40 tokens is rounded down to 32 so the chunk ends on a block boundary,
    # which leaves room for the short prompt in the same step.
    assert chunks_of(step(sched)) == [("long", 0, 32), ("short", 0, 20)]
    assert chunks_of(step(sched)) == [("long", 32, 32), ("short", 20, 1)]
    assert chunks_of(step(sched)) == [("long", 64, 32), ("short", 21, 1)]
    assert chunks_of(step(sched)) == [("long", 96, 14)]
    assert_queues_empty(sched)
    assert_all_free(sched.kv)


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_whole() -> None:
    sched = make_scheduler(
        32, block_size=16, max_num_batched_tokens=64, enable_chunked_prefill=False
    )
    sched.add(make_request("a", 40, max_tokens=2, seq=0))
    sched.add(make_request("b", 30, max_tokens=2, seq=1))
    sched.add(make_request("c", 10, max_tokens=2, seq=2))

    out = step(sched)  # b (30) does not fit the 24 left, and c may not overtake it
    assert chunks_of(out) == [("a", 0, 40)]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.requests["b"].num_computed_tokens == 0

    assert chunks_of(step(sched)) == [("a", 40, 1), ("b", 0, 30), ("c", 0, 10)]
    run_to_completion(sched)
    assert_all_free(sched.kv)


def test_max_num_seqs_caps_running_requests() -> None:
    sched = make_scheduler(32, block_size=16, max_num_batched_tokens=64, max_num_seqs=2)
    for i, rid in enumerate("abc"):
        sched.add(make_request(rid, 10, max_tokens=3, seq=i))

    ids_per_step = []
    for _ in range(5):
        out = step(sched)
        assert len(sched.running) <= 2
        ids_per_step.append([c.request_id for c in out.chunks])
    assert ids_per_step == [["a", "b"], ["a", "b"], ["a", "b"], ["c"], ["c"]]
    run_to_completion(sched)
    assert_all_free(sched.kv)


def test_running_decodes_go_before_new_prefills_and_cost_one_token() -> None:
    sched = make_scheduler(32, block_size=16, max_num_batched_tokens=64)
    for i, rid in enumerate("abc"):
        sched.add(make_request(rid, 16, max_tokens=8, seq=i))
    assert chunks_of(step(sched)) == [("a", 0, 16), ("b", 0, 16), ("c", 0, 16)]

    sched.add(make_request("new", 100, max_tokens=1, seq=3))
    out = step(sched)
    # 3 decodes of 1 token leave 61; the new prompt gets the block-aligned 48 of them.
    assert chunks_of(out) == [("a", 16, 1), ("b", 16, 1), ("c", 16, 1), ("new", 0, 48)]
    assert out.num_batched_tokens == 51
    out = step(sched)
    assert chunks_of(out) == [("a", 17, 1), ("b", 17, 1), ("c", 17, 1), ("new", 48, 52)]
    run_to_completion(sched)
    assert_all_free(sched.kv)
