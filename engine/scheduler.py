"""Token-budget scheduler: which requests run this step, and how many tokens each.

Each step closes part of every chosen request's gap (num_tokens - num_computed_tokens)
within ``max_num_batched_tokens`` tokens and ``max_num_seqs`` running requests:

1. running requests first, in admission order (a decode costs 1 token); when blocks run out
   the victim (lowest priority, then newest) is preempted by recompute or swap;
2. then, if nothing was preempted this step, swapped requests come back;
3. then waiting requests are admitted in policy order (tenants of one priority sharing the
   batch: engine/tenant_share.py).

A prefill longer than the remaining budget is cut so that the chunk ends on a block
boundary (chunked prefill), so every finished chunk fills whole blocks.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Collection, Iterable

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager, blocks_for, pool_of
from engine.request import Request, RequestStatus
from engine.scheduler_output import NewRequest, ScheduledChunk, SchedulerOutput
from engine.tenant_share import fair_order, fair_victim
from lora.manager import LoraManager

QueueKey = tuple[int, int]
Scheduled = dict[str, tuple[Request, int]]
"""This step's work so far: request id -> (request, tokens to run)."""


class Scheduler:
    """Owns the waiting / running / swapped queues and the KV manager's block tables.

    Not thread-safe: one thread (the engine's step loop) drives it.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 lora: LoraManager | None = None) -> None:
        self.config = config
        self.kv = kv
        self.lora = lora
        # An adapter whose requests waited lora_starvation_steps for a slot: until it gets
        # one, requests of other adapters are not admitted, so busy slots drain.
        self._starving_lora: str | None = None
        self.waiting: list[Request] = []  # sorted by _queue_key
        self.running: list[Request] = []  # admission order
        self.swapped: list[Request] = []  # sorted by _queue_key
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_since_last_step: list[str] = []
        # What the runner holds: for each running request, how many blocks of its table it
        # was sent. A request not in here is sent whole (NewRequest); one that stops running
        # (preempted, finished, rolled back) leaves it, and the runner forgets it too.
        self._runner_blocks: dict[str, int] = {}
        # Never preempted again in the step that brought them back (their swap-in copy
        # would race the swap-out copy of the same device blocks).
        self._swapped_in_this_step: set[str] = set()
        # Set for one schedule() call: only `_focus` (when given) and nothing in `_exclude`
        # may be scheduled (engine/fault_isolation.py runs suspects of a failed step alone).
        self._focus: str | None = None
        self._exclude: frozenset[str] = frozenset()
        self._queue_key: Callable[[Request], QueueKey] = (
            (lambda r: (-r.priority, r.arrival_seq)) if config.scheduling_policy == "priority"
            else (lambda r: (0, r.arrival_seq)))

    # ----------------------------------------------------------------- queue management
    def add(self, request: Request) -> None:
        """Queue a request; the engine checked that it fits the cache (LLMEngine.validate)."""
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=self._queue_key)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request from every queue and free its blocks at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, "abort")
        return request

    def finish(self, request_id: str, reason: str) -> None:
        """End a request for a reason found outside the scheduler (e.g. a stop string)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------------- schedule
    def schedule(self, focus: str | None = None,
                 exclude: frozenset[str] = frozenset()) -> SchedulerOutput:
        """The next step. ``focus``: schedule that request alone (others keep their blocks
        and slots, but may be preempted for it); ``exclude``: never schedule these."""
        self._focus, self._exclude = focus, exclude
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = self.config.max_num_batched_tokens
        scheduled: Scheduled = {}
        self._swapped_in_this_step.clear()
        if self._starving_lora is not None and not any(
                r.lora_name == self._starving_lora for r in self.waiting):
            self._starving_lora = None

        budget = self._schedule_running(out, scheduled, budget)
        if not out.preempted_request_ids:
            budget = self._schedule_swapped(out, scheduled, budget)
            self._schedule_waiting(out, scheduled, budget)
        out.chunks = [self._chunk(request, n, out) for request, n in scheduled.values()]
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: Scheduled, budget: int
                          ) -> int:
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING or not self._eligible(request):
                continue  # preempted earlier in this loop, or held back this step
            n = self._num_new_tokens(request, budget)
            if n == 0:
                continue
            while not self.kv.allocate_slots(request, n):
                # A pool at its cap gives up its own blocks before anyone else's.
                same_pool = [r for r in self.running if pool_of(r) == pool_of(request)]
                victim = self._pick_victim(
                    same_pool if self.kv.pool_at_cap(request, n) else self.running)
                budget += self._preempt(victim, out, scheduled)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = (request, n)
                budget -= n
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, scheduled: Scheduled, budget: int
                          ) -> int:
        for request in [r for r in self.swapped if self._eligible(r)]:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            n = self._num_new_tokens(request, budget)
            need = blocks_for(request.num_computed_tokens + n, self.kv.block_size)
            if n == 0 or need > self.kv.num_free_blocks:
                break
            if not self._take_lora_slot(request, out):
                break
            self.swapped.remove(request)
            self._swapped_in_this_step.add(request.request_id)
            out.blocks_to_swap_in.extend(self.kv.swap_in(request))
            allocated = self.kv.allocate_slots(request, n)
            assert allocated, "checked free blocks above"
            self._run(request)
            scheduled[request.request_id] = (request, n)
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, scheduled: Scheduled, budget: int
                          ) -> int:
        for request in self._admission_order():
            if budget == 0:
                break
            if request.status is not RequestStatus.WAITING or not self._eligible(request):
                continue  # admitted or finished since the order was taken, or held back
            if len(self.running) >= self.config.max_num_seqs:  # a fair share's slot?
                victim = None if self._focus else fair_victim(
                    request, self.running, self.waiting, self.config.max_num_seqs,
                    self._queue_key, self._swapped_in_this_step)
                if victim is None:
                    break
                budget += self._preempt(victim, out, scheduled)
            hit = self.kv.find_cached_prefix(request)
            if self.kv.next_block_in_flight(request, len(hit)):
                continue  # another request is computing that block now: reuse it next step
            start = len(hit) * self.kv.block_size
            n = self._num_new_tokens(request, budget, start)
            if n == 0:
                break  # does not fit this step's budget: it stays first in line
            if not self._take_lora_slot(request, out):
                continue  # its adapter has no slot (or is loading): others may run
            refund = self._allocate_for_waiting(request, n, hit, out, scheduled)
            if refund is None:
                self._drop_lora_slot(request)
                if self.kv.pool_at_cap(request, n, start):
                    continue  # only its own pool is full: other pools' requests may fit
                break
            budget += refund
            self.waiting.remove(request)
            request.num_computed_tokens = start
            if request.num_cached_tokens is None:
                request.num_cached_tokens = start
            self.kv.note_admitted(request, start)
            self._run(request)
            scheduled[request.request_id] = (request, n)
            budget -= n
        return budget

    def _eligible(self, request: Request) -> bool:
        return ((self._focus is None or request.request_id == self._focus)
                and request.request_id not in self._exclude)

    def _admission_order(self) -> list[Request]:
        """Queue order, except that while the queue is short the head's priority group
        (first cache_aware_window of it) goes longest-cached-prefix first (requests that
        waited over max_admission_delay_s keep their place ahead of it); then, within a
        priority, tenants holding fewer running requests first (engine/tenant_share.py)."""
        order = list(self.waiting)
        cfg = self.config
        if (self.kv.caching_enabled and cfg.cache_aware_window > 0
                and 1 < len(order) <= cfg.cache_aware_max_queue):
            head_priority = order[0].priority
            group = [r for r in order[:cfg.cache_aware_window] if r.priority == head_priority]
            now = time.monotonic()
            overdue = [r for r in group if now - r.timing.arrival > cfg.max_admission_delay_s]
            rest = [r for r in group if now - r.timing.arrival <= cfg.max_admission_delay_s]
            rest.sort(key=lambda r: -len(self.kv.find_cached_prefix(r)))  # stable
            order = overdue + rest + order[len(group):]
        return fair_order(order, self.running, self._queue_key)

    def _allocate_for_waiting(self, request: Request, n: int, hit: list[int],
                              out: SchedulerOutput, scheduled: Scheduled) -> int | None:
        """Blocks for a waiting request; under the priority policy strictly lower-priority
        running requests are preempted to make room. Returns the budget the victims' chunks
        gave back, or None when the request cannot be admitted."""
        refund = 0
        while not self.kv.allocate_slots(request, n, hit):
            if self.config.scheduling_policy != "priority":
                return None
            lower = [r for r in self.running if r.priority < request.priority
                     and r.request_id not in self._swapped_in_this_step]
            if not lower:
                return None
            # Preemption only releases blocks (never evicts), so ``hit`` stays cached.
            refund += self._preempt(self._pick_victim(lower), out, scheduled)
        return refund

    # -------------------------------------------------------------------- adapters
    def _take_lora_slot(self, request: Request, out: SchedulerOutput) -> bool:
        """Give the request its adapter's slot, or say it must wait."""
        name = request.lora_name
        if name is None:
            return True
        assert self.lora is not None, "requests with an adapter need a LoraManager"
        if self._starving_lora not in (None, name):
            return False
        got = self.lora.acquire(name)
        if got is None:
            request.lora_waits += 1
            if (self._starving_lora is None
                    and request.lora_waits >= self.config.lora_starvation_steps):
                self._starving_lora = name
            return False
        slot, adapter = got
        if adapter is not None:
            out.lora_loads.append((slot, adapter))
        request.lora_slot = slot
        if self._starving_lora == name:
            self._starving_lora = None
        return True

    def _drop_lora_slot(self, request: Request) -> None:
        if request.lora_slot >= 0:
            assert self.lora is not None and request.lora_name is not None
            self.lora.release(request.lora_name)
            request.lora_slot = -1

    # ------------------------------------------------------------------------ helpers
    def _num_new_tokens(self, request: Request, budget: int, start: int | None = None) -> int:
        """Tokens of the request's gap to run now (from ``start``, default its computed
        count): all of it, or a chunk ending on a block boundary, or 0 when not even one
        block-aligned chunk fits."""
        start = request.num_computed_tokens if start is None else start
        n = request.num_tokens - start
        limit = budget
        threshold = self.config.long_prefill_token_threshold
        if threshold and n > 1:
            limit = min(limit, threshold)
        if n <= limit:
            return n
        if not self.config.enable_chunked_prefill:
            return 0
        bs = self.kv.block_size
        end = (start + limit) // bs * bs
        return max(0, end - start)

    def _chunk(self, request: Request, n: int, out: SchedulerOutput) -> ScheduledChunk:
        """The step's delta for one request: the whole request (out.new_requests) if the
        runner does not hold it, and the blocks its table gained since it was last sent."""
        request_id = request.request_id
        table = self.kv.block_table(request_id)
        sent = self._runner_blocks.get(request_id)
        if sent is None:
            out.new_requests.append(NewRequest(request_id, request.all_token_ids,
                                               request.sampling_params,
                                               request.num_prompt_tokens, request.lora_slot))
            sent = 0
        self._runner_blocks[request_id] = len(table)
        start = request.num_computed_tokens
        return ScheduledChunk(request_id=request_id, start_pos=start, num_tokens=n,
                              new_block_ids=table[sent:],
                              sample=start + n == request.num_tokens)

    def _pick_victim(self, candidates: Iterable[Request]) -> Request:
        # Largest queue key = lowest priority, then newest.
        return max(candidates, key=self._queue_key)

    def _preempt(self, victim: Request, out: SchedulerOutput, scheduled: Scheduled) -> int:
        """Preempt victim; returns the budget its already-scheduled chunk gave back."""
        self.running.remove(victim)
        self._runner_blocks.pop(victim.request_id, None)
        self._drop_lora_slot(victim)
        self.num_preemptions += 1
        victim.num_preemptions += 1
        out.preempted_request_ids.append(victim.request_id)
        refunded = scheduled.pop(victim.request_id)[1] if (
            victim.request_id in scheduled) else 0
        # No swap-out in a step that swaps in: a CPU block freed by a swap-in could be
        # reused by the swap-out, and the runner copies out before it copies in.
        swap_pairs = (
            self.kv.swap_out(victim.request_id, victim.num_computed_tokens)
            if self.config.preemption_mode == "swap" and not out.blocks_to_swap_in
            else None
        )
        if swap_pairs is not None:
            out.blocks_to_swap_out.extend(swap_pairs)
            victim.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, victim, key=self._queue_key)
        else:  # recompute (or swap space full): drop the KV, start over from token 0
            self.kv.free(victim.request_id)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            bisect.insort(self.waiting, victim, key=self._queue_key)
        return refunded

    def _run(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _finish(self, request: Request, reason: str) -> None:
        queue = {
            RequestStatus.WAITING: self.waiting,
            RequestStatus.RUNNING: self.running,
            RequestStatus.SWAPPED: self.swapped,
        }.get(request.status)
        if queue is not None:
            queue.remove(request)
        self._drop_lora_slot(request)
        self.kv.free(request.request_id)
        self._runner_blocks.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    def rollback(self, out: SchedulerOutput) -> list[str]:
        """Undo a step whose forward failed: every request it scheduled, and every request
        it swapped out (their copies may not have happened), starts over by recompute, and
        adapters it placed in slots leave them (their weights may not have been copied).
        Returns the ids of the scheduled requests."""
        ids = [c.request_id for c in out.chunks]
        for request_id in ids + out.preempted_request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status is RequestStatus.WAITING:
                continue
            (self.running if request.status is RequestStatus.RUNNING
             else self.swapped).remove(request)
            self._drop_lora_slot(request)
            self.kv.free(request_id)
            self._runner_blocks.pop(request_id, None)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            bisect.insort(self.waiting, request, key=self._queue_key)
        if self.lora is not None:
            for slot, _ in out.lora_loads:
                self.lora.vacate(slot)
        return ids

    # ------------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               no_token: Collection[str] = ()) -> list[Request]:
        """Advance counters after the forward; returns the requests that got a new token
        (finished ones included, with finish_reason set). ``no_token``: requests due a token
        that their constraints allowed none of (the caller ends them)."""
        updated: list[Request] = []
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += chunk.num_tokens
            self.kv.cache_full_blocks(request)
            if not chunk.sample or chunk.request_id in no_token:
                continue
            request.append_token(sampled[chunk.request_id])
            updated.append(request)
            reason = request.check_token_stop()
            if reason is not None:
                self._finish(request, reason)
        return updated
