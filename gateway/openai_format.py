"""Engine StreamChunks -> OpenAI response objects (completion, chat, their stream chunks).

One formatter per request: it accumulates text, token ids, logprobs and the finish reason as
chunks arrive, emits stream events on the way, and builds the final object at the end.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from engine.protocol import StreamChunk
from gateway.token_bytes import TokenBytes

Endpoint = Literal["completions", "chat"]
# Engine finish reasons -> OpenAI's ("abort" and "error" never reach a successful response).
_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}
LOGPROB_FLOOR = -9999.0
"""What a logprob of -inf (or NaN) is reported as: OpenAI's own value for "impossible"; a
bare -Infinity or NaN is not JSON, and strict parsers refuse the whole response."""


def finite_logprob(value: float) -> float:
    """`value` as JSON can carry it: non-finite values become LOGPROB_FLOOR, a logprob
    never exceeds 0, and nothing goes below the floor."""
    if not math.isfinite(value):
        return LOGPROB_FLOOR
    return min(0.0, max(LOGPROB_FLOOR, value))


class ResponseFormatter:
    """Builds one request's OpenAI objects; ``top_logprobs`` None means no logprobs.

    vLLM's extras: ``return_token_ids`` adds the prompt's token ids and the generated ones
    (completions: both on the choice; chat: the prompt's on the response, the generated on
    the choice; streamed: the prompt's in the first event only, each event its new ids);
    ``tokens_as_ids`` names logprob tokens "token_id:<id>" instead of their text."""

    def __init__(self, endpoint: Endpoint, model: str, tokenizer: PreTrainedTokenizerBase,
                 top_logprobs: int | None, return_token_ids: bool = False,
                 tokens_as_ids: bool = False, token_bytes: TokenBytes | None = None) -> None:
        self.endpoint = endpoint
        self.model = model
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        self.return_token_ids = return_token_ids
        self.tokens_as_ids = tokens_as_ids
        self.token_bytes = token_bytes or TokenBytes(tokenizer)
        self.prompt_token_ids: list[int] = []
        """Set once the prompt is tokenized (what the engine ran, truncation included)."""
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprob_entries: list[tuple[int, dict[int, float]]] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._role_sent = False
        self._text_offset = 0  # text_offset of the next streamed token (completions)

    # ------------------------------------------------------------- accumulation
    def add(self, chunk: StreamChunk) -> tuple[list[tuple[int, dict[int, float]]], str]:
        """Take one engine chunk; returns its logprob entries and text."""
        ids = chunk.delta_token_ids
        self.token_ids.extend(ids)
        text = chunk.delta_text
        self.text.append(text)
        entries = [(token_id, {k: finite_logprob(v) for k, v in step.items()})
                   for token_id, step in zip(ids, chunk.logprobs or [], strict=False)]
        self.logprob_entries.extend(entries)
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.completion_tokens = chunk.completion_tokens or self.completion_tokens
        if chunk.finish_reason is not None:
            self.finish_reason = _FINISH.get(chunk.finish_reason, "stop")
        return entries, text

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    # ------------------------------------------------------------------ logprobs
    def _token(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))

    def _bytes(self, token_id: int) -> list[int]:
        return list(self.token_bytes(token_id))

    def _alternatives(self, step: dict[int, float]) -> list[tuple[int, float]]:
        ranked = sorted(step.items(), key=lambda kv: kv[1], reverse=True)
        return ranked[: self.top_logprobs or 0]

    def _completion_logprobs(self, entries: list[tuple[int, dict[int, float]]],
                             offset: int) -> dict[str, Any]:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, step in entries:
            token = self._token(token_id)
            tokens.append(token)
            token_logprobs.append(step.get(token_id))
            tops.append({self._token(t): lp for t, lp in self._alternatives(step)})
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat_logprobs(self, entries: list[tuple[int, dict[int, float]]]) -> dict[str, Any]:
        content = []
        for token_id, step in entries:
            token = self._token(token_id)
            content.append({
                "token": token, "logprob": step.get(token_id),
                "bytes": self._bytes(token_id),
                "top_logprobs": [{"token": self._token(t), "logprob": lp,
                                  "bytes": self._bytes(t)}
                                 for t, lp in self._alternatives(step)],
            })
        return {"content": content}

    def _logprobs(self, entries: list[tuple[int, dict[int, float]]], offset: int = 0
                  ) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        if self.endpoint == "chat":
            return self._chat_logprobs(entries)
        return self._completion_logprobs(entries, offset)

    # ------------------------------------------------------------------- objects
    def final(self) -> dict[str, Any]:
        text = "".join(self.text)
        logprobs = self._logprobs(self.logprob_entries)
        if self.endpoint == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": logprobs, "finish_reason": self.finish_reason}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": self.finish_reason}
            kind = "text_completion"
        response = {"id": self.id, "object": kind, "created": self.created,
                    "model": self.model, "choices": [choice], "usage": self.usage()}
        self._add_token_ids(response, choice, self.token_ids, first=True)
        return response

    def _add_token_ids(self, response: dict[str, Any], choice: dict[str, Any],
                       token_ids: list[int], first: bool) -> None:
        """vLLM's return_token_ids fields, where it puts them."""
        if not self.return_token_ids:
            return
        choice["token_ids"] = list(token_ids)
        if first:
            where = response if self.endpoint == "chat" else choice
            where["prompt_token_ids"] = list(self.prompt_token_ids)

    def stream_events(self, chunk: StreamChunk, include_usage: bool) -> list[dict[str, Any]]:
        """The SSE payloads for one engine chunk (none when it carries nothing)."""
        entries, text = self.add(chunk)
        finish = self.finish_reason if chunk.finished else None
        if (not text and not entries and finish is None and self._role_sent
                and not (self.return_token_ids and chunk.delta_token_ids)):
            return []
        first = not self._role_sent
        # Offsets count token strings, as in final(), so both report the same logprobs
        # (a token's string and its share of the text differ for partial UTF-8 and skipped
        # special tokens).
        logprobs = self._logprobs(entries, self._text_offset)
        if logprobs is not None and self.endpoint == "completions":
            self._text_offset += sum(len(token) for token in logprobs["tokens"])
        if self.endpoint == "chat":
            delta: dict[str, Any] = {"content": text}
            if not self._role_sent:
                delta = {"role": "assistant", "content": text}
                self._role_sent = True
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            self._role_sent = True
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        event: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created,
                                 "model": self.model, "choices": [choice]}
        self._add_token_ids(event, choice, chunk.delta_token_ids, first)
        if include_usage:
            event["usage"] = None
        return [event]

    def usage_event(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}
