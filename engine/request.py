"""Request state (two counters) and the outputs the engine hands back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.prompt_logprobs import PromptLogprob
from engine.sampling_params import SamplingParams
from prefix_cache.hashing import ExtraKey


class RequestStatus(enum.Enum):
    """Which queue a request is in. Prefill vs decode is never a status: it is the gap
    between num_computed_tokens and num_tokens."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class RequestTiming:
    """Wall-clock times of one request (time.monotonic seconds)."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass
class Request:
    """One generation request inside the engine.

    Invariant: 0 <= num_computed_tokens <= num_tokens. The tokens at positions
    [num_computed_tokens, num_tokens) still need a forward pass; prefill, chunked prefill,
    decode, a prefix-cache hit and recompute after preemption are all that gap closing.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_seq: int
    """Monotonic admission number; the tie-breaker of every queue order ("newest" = largest)."""
    priority: int = 0
    tenant: str | None = None
    """Whose share of the running batch it counts in (Scheduler: fair between the tenants of
    one priority); None: the engine's own caller (one tenant)."""
    lora_name: str | None = None
    """Adapter the request runs with (None: the base model)."""
    lora_slot: int = -1
    """Device slot of lora_name while the request runs; -1 otherwise."""
    lora_waits: int = 0
    """Steps this request was passed over for want of an adapter slot."""
    extra_keys: tuple[ExtraKey, ...] = ()
    """Typed keys mixed into every block hash (adapter identity, cache salt)."""
    block_hashes: list[int] = field(default_factory=list)
    """Chain hashes of the full blocks of all_token_ids known so far (filled lazily)."""
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(arrival=0.0))
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)
    """One entry per prompt position once scored (None at position 0), when asked for."""
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    """Prompt tokens read from the prefix cache when it was first admitted (None before);
    a later re-admission after preemption does not change it (what usage reports)."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    grammar: Any = None
    """Its compiled structured-output grammar (xgrammar's CompiledGrammar), if any."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def reads_prefix_cache(self) -> bool:
        """False while the prompt still needs its logprobs: they are computed, not read."""
        return self.sampling_params.prompt_logprobs is None or bool(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def _stop_token_kind(self, token_id: int) -> str | None:
        """"eos" for an end-of-sequence id (unless ignore_eos), "stop_id" for a
        stop_token_ids entry, None for any other token; an id that is both is "eos"."""
        params = self.sampling_params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "eos"
        return "stop_id" if token_id in params.stop_token_ids else None

    @property
    def ended_by_stop_token(self) -> bool:
        """It finished on a stop token (an end-of-sequence id unless ignore_eos, or one of
        stop_token_ids), whose text is then not output unless include_stop_str_in_output
        (as in vLLM; its id stays in the output ids)."""
        if self.finish_reason != "stop" or not self.output_token_ids:
            return False
        return self._stop_token_kind(self.output_token_ids[-1]) is not None

    @property
    def stop_token(self) -> int | None:
        """The stop_token_ids entry it finished on (None for an end-of-sequence id, which
        vLLM reports as no stop_reason, or any other ending)."""
        if not self.ended_by_stop_token:
            return None
        last = self.output_token_ids[-1]
        return last if self._stop_token_kind(last) == "stop_id" else None

    def check_token_stop(self) -> str | None:
        """Finish reason implied by the last token and the length limit (not stop strings)."""
        params = self.sampling_params
        if self._stop_token_kind(self.output_token_ids[-1]) is not None:
            return "stop"
        if len(self.output_token_ids) >= params.max_tokens:
            return "length"
        return None


@dataclass
class RequestOutput:
    """What the engine reports for one request after a step.

    ``text`` / ``token_ids`` are everything generated so far; ``delta_text`` /
    ``delta_token_ids`` what is new since the previous output of this request. Text never
    contains a matched stop string, and text that might still become one is held back until
    it cannot.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None
    """Set once, on the first output after the prompt was scored (when asked for)."""
    timing: RequestTiming | None = None
    error: str | None = None
    error_code: str | None = None
    """The error's code (engine/protocol.py ERROR_STATUS) when it is the request's own fault
    ("invalid_request": a 400); None: the engine's (a 500)."""
    num_cached_tokens: int = 0
    """Prompt tokens read from the prefix cache at its first admission."""
    stop_reason: int | str | None = None
    """What ended it when finish_reason is "stop": the stop string matched, the
    stop_token_ids entry sampled, or None (an end-of-sequence token), as vLLM reports it."""
