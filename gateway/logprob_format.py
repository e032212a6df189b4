"""Logprobs in OpenAI's shapes (completions' and chat's) and vLLM's prompt_logprobs.

Every value goes through finite_logprob: JSON has no -Infinity or NaN, and a strict parser
refuses a whole response that carries one.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from engine.prompt_logprobs import PromptLogprob
from gateway.token_bytes import TokenBytes

Endpoint = Literal["completions", "chat"]

LOGPROB_FLOOR = -9999.0
"""What a logprob of -inf (or NaN) is reported as: OpenAI's own value for "impossible"; a
bare -Infinity or NaN is not JSON, and strict parsers refuse the whole response."""


def finite_logprob(value: float) -> float:
    """`value` as JSON can carry it: non-finite values become LOGPROB_FLOOR, a logprob
    never exceeds 0, and nothing goes below the floor."""
    if not math.isfinite(value):
        return LOGPROB_FLOOR
    return min(0.0, max(LOGPROB_FLOOR, value))


Entry = tuple[int, dict[int, float] | None]
"""A token and its logprob map ({token: logprob}, the token's own included); None for the
first prompt token, which nothing predicts."""


class LogprobFormatter:
    """Names tokens (their text, or "token_id:<id>" with vLLM's ``tokens_as_ids``) and
    builds logprob objects with the ``top_logprobs`` most likely alternatives per step;
    ``prompt_logprobs`` (k) is vLLM's per-prompt-position count, None when not asked."""

    def __init__(self, endpoint: Endpoint, tokenizer: PreTrainedTokenizerBase,
                 top_logprobs: int | None, tokens_as_ids: bool, token_bytes: TokenBytes,
                 prompt_logprobs: int | None) -> None:
        self.endpoint = endpoint
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        self.tokens_as_ids = tokens_as_ids
        self.token_bytes = token_bytes
        self.prompt_logprobs = prompt_logprobs

    def token(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))

    def _bytes(self, token_id: int) -> list[int]:
        return list(self.token_bytes(token_id))

    def _alternatives(self, step: dict[int, float]) -> list[tuple[int, float]]:
        ranked = sorted(step.items(), key=lambda kv: kv[1], reverse=True)
        return ranked[: self.top_logprobs or 0]

    def _completion(self, entries: list[Entry], offsets: list[int]
                             ) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for token_id, step in entries:
            token = self.token(token_id)
            tokens.append(token)
            token_logprobs.append(None if step is None else step.get(token_id))
            if step is None:
                tops.append(None)
            else:  # the chosen token always among them, as OpenAI: up to logprobs + 1
                top = {self.token(t): lp for t, lp in self._alternatives(step)}
                if token_id in step:
                    top.setdefault(token, step[token_id])
                tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat(self, entries: list[Entry]) -> dict[str, Any]:
        content = []
        for token_id, step in entries:
            assert step is not None, "chat never echoes its prompt"
            token = self.token(token_id)
            content.append({
                "token": token, "logprob": step.get(token_id),
                "bytes": self._bytes(token_id),
                "top_logprobs": [{"token": self.token(t), "logprob": lp,
                                  "bytes": self._bytes(t)}
                                 for t, lp in self._alternatives(step)],
            })
        return {"content": content}

    def generated(self, entries: list[Entry], offsets: list[int]) -> dict[str, Any] | None:
        """The logprobs object of a choice (or a stream event's part of it); None without
        logprobs. ``offsets`` are the entries' text_offset (completions only)."""
        if self.top_logprobs is None:
            return None
        if self.endpoint == "chat":
            return self._chat(entries)
        return self._completion(entries, offsets)

    def prompt(self, scored: list[PromptLogprob | None] | None, token_ids: list[int]
               ) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs: per position, the prompt token's and the k most likely
        tokens' {logprob, rank, decoded_token}, keyed by token id."""
        if self.prompt_logprobs is None:
            return None
        out: list[dict[str, Any] | None] = []
        for entry in scored or [None] * len(token_ids):
            if entry is None:
                out.append(None)
                continue
            position = {str(t): {"logprob": finite_logprob(lp), "rank": rank,
                                 "decoded_token": self.token(t)}
                        for rank, (t, lp) in enumerate(entry.top[:self.prompt_logprobs], 1)}
            position[str(entry.token_id)] = {"logprob": finite_logprob(entry.logprob),
                                             "rank": entry.rank,
                                             "decoded_token": self.token(entry.token_id)}
            out.append(position)
        return out
