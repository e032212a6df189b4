"""Logprobs in OpenAI's shapes (completions' and chat's) and vLLM's prompt_logprobs.

Every value goes through finite_logprob: JSON has no -Infinity or NaN, and a strict parser
refuses a whole response that carries one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from engine.prompt_logprobs import PromptLogprob
from gateway.token_bytes import TokenBytes

Endpoint = Literal["completions", "chat"]
REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4
"""Tokens before a part of a character looked at to complete it: a character is at most
four UTF-8 bytes, so at most four tokens."""

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

    def token(self, token_id: int, context: Sequence[int] = ()) -> str:
        """The token's text where ``context`` (the sequence's tokens before it) precedes it.
        A token that holds part of a character spells nothing (""), and the one that
        completes the character spells all of it, as vLLM names them: decoded alone each
        would be U+FFFD. So the tokens of a text join into that text."""
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        text = self._alone(token_id)
        if not self._part(token_id, text):
            return text
        return self._completed(token_id, list(context[-CONTEXT_TOKENS:]))

    def _alone(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def _part(self, token_id: int, alone: str) -> bool:
        """Whether the token holds part of a character: decoded ``alone`` it ends in U+FFFD,
        and its bytes are no whole UTF-8 (else that U+FFFD is text)."""
        if not alone.endswith(REPLACEMENT):
            return False
        try:
            self.token_bytes(token_id).decode()
        except UnicodeDecodeError:
            return True
        return False

    def _completed(self, token_id: int, context: list[int]) -> str:
        """What the token adds to the text after the nearest of ``context`` that completes
        its character with it ("" when none does: the character is still incomplete). The
        parts of the character among those tokens spelled nothing: their bytes are this
        token's text too."""
        for size in range(1, len(context) + 1):
            window = context[-size:]
            joined = str(self.tokenizer.decode([*window, token_id]))
            if joined.endswith(REPLACEMENT):
                continue
            whole = size
            while whole and self._part(window[whole - 1], self._alone(window[whole - 1])):
                whole -= 1
            before = str(self.tokenizer.decode(window[:whole])) if whole else ""
            shared = 0  # before is joined's start, unless the tokenizer normalised it
            while shared < min(len(before), len(joined)) and before[shared] == joined[shared]:
                shared += 1
            return joined[shared:]
        return ""

    def _bytes(self, token_id: int) -> list[int]:
        return list(self.token_bytes(token_id))

    def _alternatives(self, step: dict[int, float]) -> list[tuple[int, float]]:
        ranked = sorted(step.items(), key=lambda kv: kv[1], reverse=True)
        return ranked[: self.top_logprobs or 0]

    def _completion(self, entries: list[Entry], offsets: list[int], context: list[int]
                    ) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for token_id, step in entries:
            token = self.token(token_id, context)
            tokens.append(token)
            token_logprobs.append(None if step is None else step.get(token_id))
            if step is None:
                tops.append(None)
            else:  # the chosen token always among them, as OpenAI: up to logprobs + 1
                top = {self.token(t, context): lp for t, lp in self._alternatives(step)}
                if token_id in step:
                    top.setdefault(token, step[token_id])
                tops.append(top)
            context.append(token_id)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat(self, entries: list[Entry], context: list[int]) -> dict[str, Any]:
        content = []
        for token_id, step in entries:
            assert step is not None, "chat never echoes its prompt"
            content.append({
                "token": self.token(token_id, context), "logprob": step.get(token_id),
                "bytes": self._bytes(token_id),
                "top_logprobs": [{"token": self.token(t, context), "logprob": lp,
                                  "bytes": self._bytes(t)}
                                 for t, lp in self._alternatives(step)],
            })
            context.append(token_id)
        return {"content": content}

    def generated(self, entries: list[Entry], offsets: list[int],
                  before: Sequence[int] = ()) -> dict[str, Any] | None:
        """The logprobs object of a choice (or a stream event's part of it); None without
        logprobs. ``offsets`` are the entries' text_offset (completions only); ``before``:
        the choice's tokens before these entries (a stream's earlier events)."""
        if self.top_logprobs is None:
            return None
        context = list(before[-CONTEXT_TOKENS:])  # each alternative names itself after
        if self.endpoint == "chat":                # the tokens sampled before it
            return self._chat(entries, context)
        return self._completion(entries, offsets, context)

    def prompt(self, scored: list[PromptLogprob | None] | None, token_ids: list[int]
               ) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs: per position, the prompt token's and the k most likely
        tokens' {logprob, rank, decoded_token}, keyed by token id."""
        if self.prompt_logprobs is None:
            return None
        out: list[dict[str, Any] | None] = []
        for index, entry in enumerate(scored or [None] * len(token_ids)):
            if entry is None:
                out.append(None)
                continue
            context = token_ids[max(0, index - CONTEXT_TOKENS):index]
            position = {str(t): {"logprob": finite_logprob(lp), "rank": rank,
                                 "decoded_token": self.token(t, context)}
                        for rank, (t, lp) in enumerate(entry.top[:self.prompt_logprobs], 1)}
            position[str(entry.token_id)] = {
                "logprob": finite_logprob(entry.logprob), "rank": entry.rank,
                "decoded_token": self.token(entry.token_id, context)}
            out.append(position)
        return out
