"""Incremental detokenization with stop strings that never leak into the output."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, a few tokens at a time.

    Each new token decodes only a short window (prefix_offset..end), so the cost per token is
    constant. A window whose text ends in U+FFFD is an incomplete UTF-8 sequence: nothing is
    emitted until the next token completes it (or the request finishes: then it is text, as
    in a full decode). While stop strings are set, the last (longest stop - 1) characters
    are held back, since they may still become a stop string; everything after a matched
    stop string is cut, and the stop string too unless include_stop. No stop string is
    matched in the text of the first min_tokens tokens.
    """

    def __init__(self, decoder: PreTrainedTokenizerBase, stop: tuple[str, ...],
                 skip_special_tokens: bool, include_stop: bool = False,
                 min_tokens: int = 0) -> None:
        self._decoder = decoder
        self._stop = stop
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self._emitted = 0
        self.stopped = False
        self.matched_stop: str | None = None
        """The stop string that ended the text (the earliest match), once stopped."""

    def add_tokens(self, token_ids: list[int]) -> None:
        """Append tokens; sets ``stopped`` if a stop string completed."""
        for token_id in token_ids:
            if self.stopped:
                return
            self._ids.append(token_id)
            self._decode_window(final=False)

    def _decode_window(self, final: bool) -> None:
        """Append the text of the tokens past the read offset; unless final, wait while it
        ends in an incomplete UTF-8 sequence (U+FFFD)."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        if len(window) > len(prefix) and (final or not window.endswith("\ufffd")):
            before = len(self.text)
            self.text += window[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._check_stop(before)

    @property
    def emitted_text(self) -> str:
        return self.text[:self._emitted]

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out that can no longer turn into a stop string. When
        finished, bytes that never completed a character are flushed as U+FFFD, as a full
        decode of the token ids would show them."""
        if finished:
            self.flush()
        end = len(self.text) if (finished or self.stopped) else len(self.text) - self._holdback
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def flush(self) -> None:
        """The request ended: bytes that never completed a character become text (U+FFFD),
        where a stop string may still complete."""
        if not self.stopped and self._read_offset < len(self._ids):
            self._decode_window(final=True)

    def _check_stop(self, before: int) -> None:
        if not self._stop or len(self._ids) < self._min_tokens:
            return
        # Only a stop string that ends in the new text: one wholly in older text was either
        # seen when that text came, or came within the first min_tokens tokens (not a stop).
        hits = [(i, len(s), s) for i, s in ((self.text.find(s, max(0, before - len(s) + 1)), s)
                                            for s in self._stop) if i >= 0]
        if hits:
            start, length, matched = min(hits)
            self.text = self.text[:start + length if self._include_stop else start]
            self.stopped = True
            self.matched_stop = matched

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        text = self._decoder.decode(ids, skip_special_tokens=self._skip_special)
        assert isinstance(text, str)
        return text
