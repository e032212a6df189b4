"""Tool calls read out of an output as its text grows, where a grammar holds their shape.

Two outputs have calls whose shape is known before they end (gateway/tool_calls.py):
``tool_choice: required``'s JSON array of ``{"name": ..., "arguments": ...}`` objects, and
``auto`` with a strict function, whose every ``<tool_call>`` block is held to
``{"name": ..., "arguments": ...}``. A call opens once its name and the ``"arguments":`` key
are out, and its arguments' text can be sent as it is generated, as OpenAI and vLLM stream a
call's arguments. The stream and the whole response read the same calls here: each call's
arguments are their text as generated (the stream's pieces joined), and a call cut short
(max_tokens, a stop string) keeps the arguments it had.

Each reader is fed the whole text so far each time (it only grows) and looks at each
character once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')
"""A call up to its arguments: matched only once all of it is there (the name's closing
quote and the key after it), so a partial text never opens a call early."""
_SPACE = " \t\n\r"
_SCALAR_END = ",}]" + _SPACE
_NEXT = {("[", "["): "{", ("}", "}"): ",", (",", ","): "{", (",", "]"): ""}
"""The array's punctuation: (what was expected, the character that came) -> what is
expected next ("" once the array ended)."""


@dataclass
class ReadCall:
    """One call: its function name and where its arguments (and, in free text, its block)
    lie in the text."""

    name: str
    block: int
    """Where the call begins (its block's open tag, or its object's brace)."""
    start: int | None = None
    """Where its arguments' text begins; None until their first character came."""
    end: int | None = None
    """Where its arguments end; None while they are still generated (or were cut short)."""
    block_end: int | None = None
    """Where the call (its block's close tag) ends; None until it did."""

    def arguments(self, text: str) -> str:
        """Its arguments' text, as far as ``text`` holds it."""
        return "" if self.start is None else text[self.start:self.end]


class _CallReader:
    """What both readers share: a call's head, then its arguments' value to its end."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        """The functions offered: a call of any other is read past, never returned (the
        grammar allows none)."""
        self.calls: list[ReadCall] = []
        self._at = 0
        self._expect = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def opened(self) -> list[ReadCall]:
        """The calls of offered functions whose arguments began."""
        return [call for call in self.calls
                if call.start is not None and call.name in self.names]

    def _read_head(self, text: str, block: int) -> bool:
        """A call's head at the reading position: False while it is not all there yet (the
        grammar allows nothing else)."""
        head = _CALL_HEAD.match(text, self._at)
        if head is None:
            return False
        self.calls.append(ReadCall(json.loads(head.group(1)), block))
        self._at = head.end()
        self._expect = "value"
        return True

    def _read_value_start(self, text: str) -> None:
        while self._at < len(text) and text[self._at] in _SPACE:
            self._at += 1
        if self._at < len(text):
            self.calls[-1].start = self._at
            self._expect = "arguments"

    def _read_arguments(self, text: str, then: str) -> None:
        """Through the arguments' value (an object or array to its matching bracket, a
        string to its closing quote, a number or literal to the character after it); then
        ``then`` is expected."""
        start = self.calls[-1].start
        assert start is not None
        scalar = text[start] not in '{["'
        while self._at < len(text):
            char = text[self._at]
            ended = False
            if scalar:
                if char in _SCALAR_END:
                    self.calls[-1].end = self._at
                    self._expect = then
                    return
            elif self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                    ended = self._depth == 0  # the value was this string
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                ended = self._depth == 0
            self._at += 1
            if ended:
                self.calls[-1].end = self._at
                self._expect = then
                return


class CallArrayReader(_CallReader):
    """The calls of a forced call array. Text that leaves the array's shape stops the
    reading: the calls read before it stay."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self._expect = "["
        """What comes next: "[" (the array), "{" (a call), "value" (its arguments' first
        character), "arguments" (inside them), "}" (the call's end) or "," (another call,
        or "]"); "" once the array ended or the text left its shape."""

    def feed(self, text: str) -> list[ReadCall]:
        """Read what ``text`` adds to the text fed before; returns every call opened."""
        while self._expect and self._at < len(text):
            if self._expect == "{":
                if not self._read_head(text, self._at):
                    break
            elif self._expect == "value":
                self._read_value_start(text)
            elif self._expect == "arguments":
                self._read_arguments(text, "}")
            elif text[self._at] in _SPACE:
                self._at += 1
            elif (self._expect, text[self._at]) in _NEXT:
                if self._expect == "}":
                    self.calls[-1].block_end = self._at + 1
                self._expect = _NEXT[self._expect, text[self._at]]
                self._at += 1
            else:
                self._expect = ""  # not the array's shape: nothing more is read
        return self.opened()


class CallBlockReader(_CallReader):
    """The calls of ``auto`` text whose call blocks a grammar holds: free text, and
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks in it."""

    def __init__(self, names: frozenset[str], open_tag: str, close_tag: str) -> None:
        super().__init__(names)
        self._open_tag = open_tag
        self._block_end = re.compile(r"\s*\}\s*" + re.escape(close_tag))
        self._expect = "text"
        """"text" (outside blocks), "head" (after an open tag), "value", "arguments" or
        "close" (the call's brace and close tag)."""
        self.blocks: list[int] = []
        """Where each block that opened begins (a call's, or one cut before its head)."""

    def feed(self, text: str) -> list[ReadCall]:
        """Read what ``text`` adds to the text fed before; returns every call opened."""
        while self._at < len(text):
            if self._expect == "text":
                found = text.find(self._open_tag, self._at)
                if found < 0:  # a tag may be cut at the end: look at its start again
                    self._at = max(self._at, len(text) - len(self._open_tag) + 1)
                    break
                self.blocks.append(found)
                self._at = found + len(self._open_tag)
                self._expect = "head"
            elif self._expect == "head":
                if not self._read_head(text, self.blocks[-1]):
                    break
            elif self._expect == "value":
                self._read_value_start(text)
            elif self._expect == "arguments":
                self._read_arguments(text, "close")
            else:
                close = self._block_end.match(text, self._at)
                if close is None:
                    break
                self.calls[-1].block_end = self._at = close.end()
                self._expect = "text"
        return self.opened()

    def outside(self, text: str) -> tuple[str, str]:
        """The text before the first block, and the text after it outside blocks (a block
        cut short, or cut before its head, runs to the end)."""
        if not self.blocks:
            return text, ""
        ends = {call.block: call.block_end for call in self.calls}
        pieces, at = [], self.blocks[0]
        for begin in self.blocks:
            pieces.append(text[at:begin])
            end = ends.get(begin)
            if end is None:
                return text[:self.blocks[0]], "".join(pieces)
            at = end
        return text[:self.blocks[0]], "".join(pieces) + text[at:]
