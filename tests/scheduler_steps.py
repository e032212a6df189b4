"""Driving a Scheduler by hand, with no model: factories and one-step helpers shared by the
scheduler tests. Every chunk that samples is fed the fixed TOKEN."""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import torch

from engine.config import EngineConfig
from engine.input_batch import InputBatch
from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput

TOKEN = 7  # what the "model" samples every time; ignore_eos keeps it from stopping anything

Chunk = tuple[str, int, int]  # (request_id, start_pos, num_tokens)


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


_runner_copies: WeakKeyDictionary[Scheduler, InputBatch] = WeakKeyDictionary()


def runner_copy(sched: Scheduler) -> InputBatch:
    """The copies of sched's running requests that a model runner would hold, kept by the
    runner's own InputBatch from the scheduler's outputs (see feed_runner)."""
    if sched not in _runner_copies:
        cfg = sched.config
        _runner_copies[sched] = InputBatch(cfg.max_num_seqs, sched.kv.num_blocks,
                                           cfg.max_num_batched_tokens, cfg.block_size,
                                           torch.device("cpu"))
    return _runner_copies[sched]


def feed_runner(sched: Scheduler, out: SchedulerOutput) -> None:
    """Apply a step's output to the runner copy as the runner does, sampling TOKEN."""
    copy = runner_copy(sched)
    copy.apply(out)
    copy.prepare(sorted(out.chunks, key=lambda c: c.num_tokens != 1))
    for c in out.chunks:
        if c.sample:
            copy.append_sampled(c.request_id, TOKEN)


def assert_runner_in_sync(sched: Scheduler) -> None:
    """Every running request's runner copy has the scheduler's tokens and block table."""
    copies = runner_copy(sched)
    for request in sched.running:
        request_id = request.request_id
        assert copies.requests[request_id].token_ids == request.all_token_ids, request_id
        assert copies.block_table(request_id).tolist() == sched.kv.block_table(request_id), (
            request_id)


def tables_of(sched: Scheduler, out: SchedulerOutput) -> dict[str, list[int]]:
    """The block table of each request of a step that step() ran, as the runner saw it."""
    copies = runner_copy(sched)
    return {c.request_id: copies.block_table(c.request_id).tolist() for c in out.chunks}


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, feed the runner copy, then report TOKEN
    for each sampling chunk; checks that the runner copy stays in sync."""
    out = sched.schedule()
    feed_runner(sched, out)
    sched.update(out, {c.request_id: TOKEN for c in out.chunks if c.sample})
    assert_runner_in_sync(sched)
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs: list[SchedulerOutput] = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(step(sched))
    return outs


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.swap_pool.num_free == kv.swap_pool.num_blocks


def assert_queues_empty(sched: Scheduler) -> None:
    assert (sched.waiting, sched.running, sched.swapped, sched.requests) == ([], [], [], {})


def three_one_block_requests(policy: str, priorities: tuple[int, int, int]) -> Scheduler:
    """a, b, c (arrival order) each hold one full block of 4; one block is left free, so the
    next step's decodes (each needs a second block) run out after the first one."""
    sched = make_scheduler(4, block_size=4, max_num_batched_tokens=64, scheduling_policy=policy)
    for i, (rid, priority) in enumerate(zip("abc", priorities, strict=True)):
        sched.add(make_request(rid, 4, max_tokens=8, seq=i, priority=priority))
    step(sched)
    assert sched.kv.num_free_blocks == 1
    return sched
