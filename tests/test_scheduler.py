"""Scheduler: token budget, block-aligned chunks, admission order, preemption, swap, aborts.

No model is involved: the tests drive Scheduler.schedule() / update() by hand, feeding a fixed
token for every chunk that samples, and check the exact chunks, queues and block ids.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager, blocks_for
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput

TOKEN = 7  # what the "model" samples every time; ignore_eos keeps it from stopping anything

Chunk = tuple[str, int, int]  # (request_id, start_pos, num_tokens)


# ------------------------------------------------------------------------------ factories
def make_request(
    request_id: str, prompt_len: int, *, max_tokens: int = 4, seq: int = 0, priority: int = 0
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(prompt_len)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=frozenset(),
        arrival_seq=seq,
        priority=priority,
    )


def make_scheduler(num_blocks: int, num_swap_blocks: int = 0, **config: Any) -> Scheduler:
    """Scheduler over a fresh KV pool; config overrides EngineConfig fields."""
    cfg = EngineConfig(model="unused", **config)
    return Scheduler(cfg, KVCacheManager(num_blocks, cfg.block_size, num_swap_blocks))


def chunks_of(out: SchedulerOutput) -> list[Chunk]:
    return [(c.request_id, c.start_pos, c.num_tokens) for c in out.chunks]


def tables_of(out: SchedulerOutput) -> dict[str, list[int]]:
    return {c.request_id: list(c.block_table) for c in out.chunks}


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, then report TOKEN for each sampling chunk."""
    out = sched.schedule()
    sched.update(out, {c.request_id: TOKEN for c in out.chunks if c.sample})
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(step(sched))
    return outs


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.swap_pool.num_free == kv.swap_pool.num_blocks


def assert_queues_empty(sched: Scheduler) -> None:
    assert (sched.waiting, sched.running, sched.swapped, sched.requests) == ([], [], [], {})


# --------------------------------------------------------------------- budget and chunks
def test_budget_split_cuts_second_prompt_on_block_boundary() -> None:
    sched = make_scheduler(32, block_size=16, max_num_batched_tokens=64)
    sched.add(make_request("a", 40, max_tokens=2, seq=0))
    sched.add(make_request("b", 50, max_tokens=2, seq=1))

    out = step(sched)  # 40 + 16 = 56 <= 64 < 40 + 32
    assert chunks_of(out) == [("a", 0, 40), ("b", 0, 16)]
    assert [c.sample for c in out.chunks] == [True, False]
    assert tables_of(out) == {"a": [0, 1, 2], "b": [3]}
    assert out.num_batched_tokens == 56

    out = step(sched)  # a decodes, b finishes its prompt
    assert chunks_of(out) == [("a", 40, 1), ("b", 16, 34)]
    assert [c.sample for c in out.chunks] == [True, True]
    assert tables_of(out) == {"a": [0, 1, 2], "b": [3, 4, 5, 6]}
    assert out.chunks[0].token_ids == [TOKEN]
    assert out.chunks[1].token_ids == list(range(16, 50))

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
            assert len(c.block_table) == blocks_for(c.context_len, bs)
        owned = [b for r in sched.running for b in kv.block_table(r.request_id)]
        assert len(owned) == len(set(owned))
        assert len(owned) + kv.num_free_blocks == kv.num_blocks

        sched.update(out, {c.request_id: TOKEN for c in out.chunks if c.sample})
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


# ----------------------------------------------------------------------------- preemption
def three_one_block_requests(policy: str, priorities: tuple[int, int, int]) -> Scheduler:
    """a, b, c (arrival order) each hold one full block of 4; one block is left free, so the
    next step's decodes (each needs a second block) run out after the first one."""
    sched = make_scheduler(4, block_size=4, max_num_batched_tokens=64, scheduling_policy=policy)
    for i, (rid, priority) in enumerate(zip("abc", priorities, strict=True)):
        sched.add(make_request(rid, 4, max_tokens=8, seq=i, priority=priority))
    step(sched)
    assert sched.kv.num_free_blocks == 1
    return sched


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
    assert tables_of(out) == {"a": [0, 3], "b": [1, 2]}
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
    assert tables_of(out) == {"a": [0, 3], "c": [1, 2]}
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
    assert tables_of(step(sched)) == {"low": [0, 1], "high": [2]}

    out = step(sched)  # low decodes at 5 (no new block), high at 4 needs one
    assert out.preempted_request_ids == ["low"]
    assert chunks_of(out) == [("high", 4, 1)]
    assert out.num_batched_tokens == 1
    assert tables_of(out) == {"high": [2, 1]}  # low released [1, 0], last block first
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
    assert tables_of(out) == {"high": [3, 2]}  # low released last block first
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


# ----------------------------------------------------------------------------------- swap
def swap_scenario(num_swap_blocks: int) -> Scheduler:
    """a (8 + 12 tokens) and b (8 + 8 tokens) over 6 blocks of 4: after five steps both
    decode at position 12 and need a fourth block, with none free."""
    sched = make_scheduler(
        6, num_swap_blocks, block_size=4, max_num_batched_tokens=64, preemption_mode="swap"
    )
    sched.add(make_request("a", 8, max_tokens=12, seq=0))
    sched.add(make_request("b", 8, max_tokens=8, seq=1))
    assert tables_of(step(sched)) == {"a": [0, 1], "b": [2, 3]}
    assert tables_of(step(sched)) == {"a": [0, 1, 4], "b": [2, 3, 5]}
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
    assert tables_of(out) == {"a": [0, 1, 4, 5]}  # b's blocks were released as 5, 3, 2
    b = sched.requests["b"]
    assert sched.swapped == [b]
    assert (b.status, b.num_computed_tokens, b.num_tokens) == (RequestStatus.SWAPPED, 12, 13)
    assert kv.swap_pool.num_free == 1

    # b needs 4 device blocks to come back; at most 2 are free until a finishes, which it
    # does in the last of these steps.
    for i in range(6):
        out = step(sched)
        assert chunks_of(out) == [("a", 13 + i, 1)]
        assert tables_of(out) == {"a": [0, 1, 4, 5] if i < 3 else [0, 1, 4, 5, 3]}
        assert out.blocks_to_swap_in == []
        assert sched.swapped == [b]

    out = step(sched)
    assert out.finished_request_ids == ["a"]
    # Free queue: 2, then a's blocks last first (3, 5, 4, 1, 0).
    assert out.blocks_to_swap_in == [(0, 2), (1, 3), (2, 5)]  # (cpu, device)
    assert chunks_of(out) == [("b", 12, 1)]
    assert tables_of(out) == {"b": [2, 3, 5, 4]}
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


# ------------------------------------------------------------------------------ rejection
def test_request_larger_than_whole_cache_is_rejected() -> None:
    sched = make_scheduler(4, block_size=4, max_num_batched_tokens=64)  # 16 tokens in all
    with pytest.raises(ValueError, match="more than the whole cache"):
        sched.add(make_request("big", 12, max_tokens=5))
    assert_queues_empty(sched)
    assert not sched.has_unfinished()

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
