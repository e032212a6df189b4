"""The runner's grammar matchers (xgrammar), one per running request that has a grammar, and
the CPU budget that keeps one request's grammar from stalling every other request.

Masking runs inside the engine step, in one thread, for the whole batch: a grammar whose
matching explodes (a regex nesting repetitions of overlapping alternatives, such as
``((a|aa)*){1,100}c``, compiles in milliseconds, then its matcher's work grows about tenfold
with each token: 0.01 s, 0.1 s, 1 s, 4 s, 14 s) would hold every request of the engine
behind it, and a client hanging up cannot interrupt a step. So each request's matcher time
is measured (its thread's CPU time, which load from other processes does not inflate) and a
request over budget ends with an error before its next step: one token costing more than
STEP_BUDGET_S, or all of its tokens more than BASE_BUDGET_S plus PER_TOKEN_BUDGET_S per
token. Ordinary schemas, regexes and grammars cost well under a millisecond a token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
STEP_BUDGET_S = 0.1
"""The most one token's matching (mask, then accepting the token) may cost."""
BASE_BUDGET_S = 1.0
PER_TOKEN_BUDGET_S = 0.01
"""A request's matching may cost BASE_BUDGET_S + PER_TOKEN_BUDGET_S per token in all."""
OVER_BUDGET_MESSAGE = (
    "structured output: this request's grammar is too costly to match ({spent}); simplify "
    "it (a regex that nests repetitions of overlapping alternatives, such as (a|aa)* inside "
    "another repetition, makes matching grow with every token)")


@dataclass
class _Matcher:
    """A request's matcher and what its matching has cost."""

    matcher: Any
    spent_s: float = 0.0
    tokens: int = 0
    masked_s: float = 0.0
    """This step's mask, until its token is accepted."""
    over: str | None = None
    """Why it went over its budget (set: its request ends before its next token)."""

    def charge(self, step_s: float) -> None:
        """Count one token's matching (its mask and its acceptance)."""
        self.spent_s += step_s
        if step_s > STEP_BUDGET_S:
            self.over = (f"{step_s * 1000:.0f} ms of CPU for one token, over "
                         f"{STEP_BUDGET_S * 1000:.0f} ms")
        elif self.spent_s > BASE_BUDGET_S + PER_TOKEN_BUDGET_S * self.tokens:
            self.over = f"{self.spent_s:.1f} s of CPU for {self.tokens} tokens"


class GrammarMatchers:
    """The matchers of a runner's requests and the bitmask buffer of a step."""

    def __init__(self, max_rows: int) -> None:
        self._matchers: dict[str, _Matcher] = {}
        self._max_rows = max_rows
        self._bitmask: torch.Tensor | None = None

    def prepare(self, request_id: str, compiled: Any) -> None:
        import xgrammar

        self._matchers[request_id] = _Matcher(xgrammar.GrammarMatcher(compiled))
        if self._bitmask is None:
            self._bitmask = xgrammar.allocate_token_bitmask(
                self._max_rows, compiled.tokenizer_info.vocab_size)

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, raw: torch.Tensor, request_ids: list[str]
             ) -> torch.Tensor:
        """``logits`` [N, V] (already adjusted) with the grammar-forbidden tokens of each
        constrained row set to -inf; a copy when ``logits`` is ``raw`` (whose values the
        logprobs report)."""
        rows = [i for i, r in enumerate(request_ids) if r in self._matchers]
        if not rows:
            return logits
        import xgrammar

        assert self._bitmask is not None
        if logits is raw:
            logits = logits.clone()
        for i in rows:
            held = self._matchers[request_ids[i]]
            started = time.thread_time()
            held.matcher.fill_next_token_bitmask(self._bitmask, i)
            held.masked_s = time.thread_time() - started
        xgrammar.apply_token_bitmask_inplace(logits, self._bitmask[:len(request_ids)].to(
            logits.device), indices=rows)
        return logits

    def accept(self, request_ids: list[str], tokens: list[int]) -> dict[str, str]:
        """Advance each request's matcher by its sampled token; the requests over their
        budget, each with why (their matchers are not advanced: the request ends)."""
        over: dict[str, str] = {}
        for request_id, token in zip(request_ids, tokens, strict=True):
            held = self._matchers.get(request_id)
            if held is None:
                continue
            held.tokens += 1
            if held.masked_s > STEP_BUDGET_S:  # accepting would cost as much again
                held.charge(held.masked_s)
            elif not held.matcher.is_terminated():
                started = time.thread_time()
                if not held.matcher.accept_token(token):
                    log.warning("request %s: token %d is outside its grammar", request_id,
                                token)
                held.charge(held.masked_s + time.thread_time() - started)
            held.masked_s = 0.0
            if held.over is not None:
                over[request_id] = OVER_BUDGET_MESSAGE.format(spent=held.over)
        return over
