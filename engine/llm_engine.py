"""LLMEngine: step() = schedule -> run -> update -> outputs. Single-threaded."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.fault_isolation import FaultIsolation
from engine.generation_defaults import SamplingDefaults, read_sampling_defaults
from engine.kv_cache import KVCacheManager
from engine.metrics import EngineMetrics, EngineStats, PrefixCacheStats, StepTiming
from engine.model_runner import ModelRunner
from engine.models.loader import (
    describe_placement,
    load_hf_config,
    load_model,
    resolve_dtype,
)
from engine.models.shape import ModelShape
from engine.prompt_logprobs import PromptLogprob
from engine.request import Request, RequestOutput, RequestStatus
from engine.request_builder import RequestBuilder, eos_token_ids
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from lora.adapter import LoraAdapter
from lora.adapter_info import AdapterInfo
from lora.manager import LoraManager
from prefix_cache.adaptive import AdaptiveConfig
from prefix_cache.cache import PrefixUpdate

if TYPE_CHECKING:
    from engine.kv_events import KVEventPublisher

log = logging.getLogger(__name__)
STEP_FAILED_MESSAGE = "the engine could not run this request (internal error)"
"""What the request whose step failed is told; details go to the engine's log only."""
NO_TOKEN_MESSAGE = ("no token is allowed to come next: the request's allowed_token_ids, "
                    "bad_words, min_tokens and structured output together exclude every "
                    "token of the vocabulary here")
"""What a request is told whose constraints left no token to sample (a 400: its own)."""
NON_FINITE_MESSAGE = ("the model computed NaN or infinite logits for this request, so no "
                      "token can be sampled: its adapter's weights overflow (or the model's)")
"""What a request is told whose logits were not numbers (a 500; the batch goes on)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


@dataclass
class _Tracked:
    """Engine-side companions of a scheduler Request: its detokenizer and output cursor."""

    request: Request
    detokenizer: IncrementalDetokenizer
    num_tokens_reported: int = 0
    prompt_logprobs_reported: bool = False

    @property
    def stop_reason(self) -> int | str | None:
        """RequestOutput.stop_reason of the finished request."""
        if self.request.finish_reason != "stop":
            return None
        if self.detokenizer.matched_stop is not None:
            return self.detokenizer.matched_stop
        return self.request.stop_token


class LLMEngine:
    """One model replica. Not thread-safe: AsyncEngine drives it from one thread."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        hf_config = load_hf_config(config.model)
        self.model_shape = ModelShape.from_hf_config(hf_config)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            # Per thread in effect (OpenMP and MKL keep the count per thread): this is the
            # engine thread, which runs every forward. OMP_NUM_THREADS, read at start-up,
            # is what binds a whole process (`loragate serve` sets it for its engines).
            torch.set_num_threads(config.cpu_threads)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self.max_model_len = config.max_model_len or self.model_shape.max_position_embeddings
        if self.max_model_len > self.model_shape.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={self.model_shape.max_position_embeddings}")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}), or a long prompt could never be scheduled")
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            config.model, local_files_only=True)
        self.eos_token_ids = eos_token_ids(config, self.tokenizer)
        self.sampling_defaults = (read_sampling_defaults(config.model)
                                  if config.generation_config == "auto" else SamplingDefaults())
        """What a request that leaves a sampling field unset gets (the HTTP edge and
        LLM.generate without params apply it; a SamplingParams is always explicit)."""
        model = load_model(config.model, hf_config, self.dtype, self.device, self.max_model_len,
                           prepack_weights=config.prepack_weights,
                           dummy_seed=config.seed if config.load_format == "dummy" else None)
        self.runner = ModelRunner(config, model, self.device, self.dtype, self.eos_token_ids)
        log.info("%s in %s on %s%s, %d KV blocks of %d tokens", Path(config.model).name,
                 str(self.dtype).removeprefix("torch."), self.device,
                 describe_placement(config.dtype, self.dtype, self.device),
                 self.runner.num_blocks, config.block_size)
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.block_size, self.runner.num_swap_blocks,
            prefix_caching=config.prefix_caching,
            adaptive=AdaptiveConfig(threshold=config.prefix_auto_threshold),
            publish_every=config.prefix_publish_every, pool_shares=config.kv_pool_shares,
            pool_default_cap=config.kv_pool_default_cap)
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events_endpoint is not None:
            from engine.kv_events import KVEventPublisher  # pyzmq only when events are on
            self.kv_events = KVEventPublisher(
                config.kv_events_endpoint, config.block_size,
                config.kv_events_replay_endpoint, config.kv_events_topic,
                config.kv_events_buffer_steps, config.kv_events_format)
            self.kv.pool.events = self.kv_events
        self.lora = (LoraManager(self.model_shape.lora_targets(), config.max_loras,
                                 config.max_cpu_loras, config.max_lora_rank)
                     if config.max_loras else None)
        self.scheduler = Scheduler(config, self.kv, self.lora)
        self.metrics = EngineMetrics()
        self._tracked: dict[str, _Tracked] = {}
        self.last_step_idle = False
        """The last step scheduled nothing (e.g. every request waits for an adapter load)."""
        self._arrival_counter = itertools.count()
        self.requests = RequestBuilder(self.tokenizer, self.model_shape, self.max_model_len,
                                       self.eos_token_ids, self.kv, self.lora,
                                       config.grammar_compile_timeout_s)
        """Builds validated Requests (any thread may use it: it changes no engine state)."""
        self.isolation = FaultIsolation()

    @classmethod
    def from_model(cls, model: str, **overrides: Any) -> LLMEngine:
        return cls(EngineConfig(model=model, **overrides))

    # ------------------------------------------------------------------ requests in
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    lora: str | None = None) -> None:
        self.add(self.requests.make_request(request_id, prompt, params or SamplingParams(),
                                            priority, arrival_time, cache_salt, lora))

    def add(self, request: Request) -> None:
        """Admit a request built by self.requests.make_request()."""
        if request.request_id in self._tracked:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request = replace(self.requests.with_current_adapter(request),
                          arrival_seq=next(self._arrival_counter))
        params = request.sampling_params
        self.scheduler.add(request)
        # Per-request sampling state is made here, so nothing about it can fail in a step.
        self.runner.sampler.prepare(request.request_id, params)
        if request.grammar is not None:
            self.runner.grammars.prepare(request.request_id, request.grammar)
        self._tracked[request.request_id] = _Tracked(
            request, IncrementalDetokenizer(self.tokenizer, params.stop,
                                            params.skip_special_tokens,
                                            params.include_stop_str_in_output,
                                            params.min_tokens))
        self.metrics.prompt_tokens += request.num_prompt_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its blocks; returns its final output."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self.runner.release([request_id])
        return self._output(self._tracked[request_id], finished_here=True)

    # --------------------------------------------------------------------- adapters
    def _lora_manager(self) -> LoraManager:
        if self.lora is None:
            raise ValueError("LoRA is disabled (max_loras=0)")
        return self.lora

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Validate a PEFT directory and register it (validation is the slow part: callers
        on another thread use validate_lora() there and add_lora() here)."""
        adapter = self.validate_lora(name, path)
        self.add_lora(adapter)
        return adapter

    def validate_lora(self, name: str, path: str) -> LoraAdapter:
        """Thread-safe: reads and checks the adapter, touches no engine state."""
        return self._lora_manager().validate(name, path)

    def add_lora(self, adapter: LoraAdapter) -> None:
        self._lora_manager().add(adapter)

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter; refused while any request (running or queued) uses it."""
        users = [r.request_id for r in self.scheduler.requests.values() if r.lora_name == name]
        if users:
            raise ValueError(f"adapter {name!r} is in use by {len(users)} request(s)")
        self._lora_manager().remove(name)
        self.kv.pool.drop_pool(name)  # its KV pool goes too, and its /metrics series

    def pin_lora(self, name: str, pinned: bool = True) -> None:
        self._lora_manager().pin(name, pinned)

    def list_loras(self) -> list[AdapterInfo]:
        return self.lora.infos() if self.lora is not None else []

    def _fail_broken_adapter_requests(self) -> list[RequestOutput]:
        """Requests waiting for an adapter whose weights failed to load end with an error."""
        assert self.lora is not None
        self.lora.poll()
        if not self.lora.load_errors:
            return []
        outputs = []
        for request in list(self.scheduler.waiting) + list(self.scheduler.swapped):
            error = self.lora.load_errors.get(request.lora_name or "")
            if error is not None:
                outputs.append(self._fail(request.request_id, error))
        return outputs

    def _fail(self, request_id: str, error: str, code: str | None = None) -> RequestOutput:
        """End one request with an error (its final output carries it, and its code when
        the request itself is at fault)."""
        self.scheduler.finish(request_id, "error")
        self.runner.release([request_id])
        out = self._output(self._tracked[request_id], finished_here=True)
        out.error, out.error_code = error, code
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        if self.kv_events is not None:  # one batch per step, whatever path the step took
            self.kv_events.flush()
        return outputs

    def _step(self) -> list[RequestOutput]:
        failed = self._fail_broken_adapter_requests() if self.lora is not None else []
        t0 = time.perf_counter()
        focus, suspects = self.isolation.plan(self.scheduler.requests)
        sched = self.scheduler.schedule(focus)
        if focus is not None and sched.is_empty:
            # The suspect cannot run now: let everyone else run, so it gets what it waits for.
            self.runner.abandon(sched)
            focus, sched = None, self.scheduler.schedule(exclude=suspects)
        t1 = time.perf_counter()
        self.last_step_idle = sched.is_empty
        if sched.is_empty:
            self.runner.abandon(sched)
            return failed
        try:
            result = self.runner.execute(sched)
        except Exception:
            log.exception("a step of %d request(s) failed; isolating the cause",
                          len(sched.chunks))
            self.runner.abandon(sched)
            culprits = self.isolation.failed(self.scheduler.rollback(sched), focus)
            return failed + [self._fail(r, STEP_FAILED_MESSAGE) for r in culprits]
        self.isolation.succeeded(sched)
        t2 = time.perf_counter()
        self._store_prompt_logprobs(result.prompt_logprobs)
        updated = self.scheduler.update(sched, result.sampled, result.no_token +
                                        result.non_finite + list(result.grammar_over_budget))
        now = time.monotonic()
        outputs = failed + [self._on_new_token(self._tracked[r.request_id], result.logprobs,
                                               now) for r in updated]
        outputs += [self._fail(r, NO_TOKEN_MESSAGE, "invalid_request") for r in result.no_token]
        outputs += [self._fail(r, NON_FINITE_MESSAGE) for r in result.non_finite]
        outputs += [self._fail(r, why, "invalid_request")
                    for r, why in result.grammar_over_budget.items()]
        t3 = time.perf_counter()
        prefill_tokens = sum(c.num_tokens for c in sched.chunks if not c.sample or
                             c.num_tokens > 1)
        self.metrics.record_step(
            sched.num_batched_tokens, prefill_tokens, self.config.max_num_batched_tokens,
            StepTiming(schedule=t1 - t0, prepare=result.prepare_seconds,
                       forward=result.forward_seconds, sample=result.sample_seconds,
                       output=t3 - t2))
        return outputs

    def _store_prompt_logprobs(self, scored: dict[str, tuple[int, list[PromptLogprob]]]
                               ) -> None:
        for request_id, (first, entries) in scored.items():
            request = self._tracked[request_id].request
            if not request.prompt_logprobs:
                request.prompt_logprobs = [None] * request.num_prompt_tokens
            request.prompt_logprobs[first:first + len(entries)] = entries

    def _on_new_token(self, tracked: _Tracked, logprobs: dict[str, dict[int, float]],
                      now: float) -> RequestOutput:
        request = tracked.request
        timing = request.timing
        if timing.first_token is None:
            timing.first_token = now
        else:
            assert timing.last_token is not None
            timing.inter_token_latencies.append(now - timing.last_token)
        timing.last_token = now
        self.metrics.generation_tokens += 1
        if request.request_id in logprobs:
            request.output_logprobs.append(logprobs[request.request_id])
        new_ids = request.output_token_ids[tracked.num_tokens_reported:]
        if (request.ended_by_stop_token
                and not request.sampling_params.include_stop_str_in_output):
            new_ids = new_ids[:-1]  # the stop token's text is not output
        tracked.detokenizer.add_tokens(new_ids)
        if request.status is RequestStatus.FINISHED:
            tracked.detokenizer.flush()  # its last bytes may complete a stop string too
        if tracked.detokenizer.stopped:
            if request.status is not RequestStatus.FINISHED:
                self.scheduler.finish(request.request_id, "stop")
            else:  # it reached max_tokens on the token that completed a stop string: the
                request.finish_reason = "stop"  # stop string ended it (as in vLLM)
        return self._output(tracked, finished_here=request.status is RequestStatus.FINISHED)

    def _output(self, tracked: _Tracked, finished_here: bool) -> RequestOutput:
        request = tracked.request
        new_ids = request.output_token_ids[tracked.num_tokens_reported:]
        tracked.num_tokens_reported = len(request.output_token_ids)
        if finished_here:
            del self._tracked[request.request_id]
            self.metrics.num_requests_finished += 1
        delta_text = tracked.detokenizer.take_delta(finished_here)
        prompt_logprobs = None
        # Reported once, with the first token: sampling it needed the whole prompt scored.
        if (request.sampling_params.prompt_logprobs is not None and new_ids
                and not tracked.prompt_logprobs_reported):
            tracked.prompt_logprobs_reported = True
            prompt_logprobs = request.prompt_logprobs or [None] * request.num_prompt_tokens
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            text=tracked.detokenizer.emitted_text,
            token_ids=list(request.output_token_ids),
            delta_text=delta_text,
            delta_token_ids=new_ids,
            finished=finished_here,
            finish_reason=request.finish_reason if finished_here else None,
            logprobs=list(request.output_logprobs)
            if request.sampling_params.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
            timing=request.timing,
            num_cached_tokens=request.num_cached_tokens or 0,
            stop_reason=tracked.stop_reason if finished_here else None,
        )

    # ---------------------------------------------------------------------- metrics
    def stats(self) -> EngineStats:
        m = self.metrics
        tracker = self.kv.tracker
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_total=self.kv.num_blocks,
            token_budget_utilization=m.last_budget_utilization,
            mean_token_budget_utilization=m.mean_budget_utilization,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=m.prompt_tokens,
            prompt_tokens_computed=m.prompt_tokens_computed,
            generation_tokens=m.generation_tokens,
            num_steps=m.num_steps,
            num_requests_finished=m.num_requests_finished,
            phase_seconds=dict(m.phase_seconds),
            waiting_adapters=tuple(sorted({
                r.lora_name for r in [*self.scheduler.waiting, *self.scheduler.swapped]
                if r.lora_name is not None})),
            block_size=self.config.block_size,
            prefix_cache=PrefixCacheStats(
                enabled=tracker.enabled,
                rolling_hit_rate=tracker.rolling_hit_rate,
                cached_blocks=self.kv.pool.num_cached,
                switches=tracker.num_switches,
                pools=self.kv.pools.stats(),
                retired=self.kv.pools.retired_stats(),
            ),
        )

    def publish_prefixes(self, cursor: int = 0) -> PrefixUpdate:
        """Sparse chain hashes cached since ``cursor``, for the gateway's prefix index."""
        return self.kv.pool.publish(cursor)
