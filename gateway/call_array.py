"""The calls of a forced ``tool_choice: required`` output, read as its text grows.

That output is a JSON array of ``{"name": ..., "arguments": ...}`` objects, generated under
a grammar (gateway/tool_calls.py), so its shape is known before it ends: a call opens once
its name and the ``"arguments":`` key are out, and its arguments' text can be sent as it is
generated, as OpenAI and vLLM stream a call's arguments. The stream and the whole response
read the same calls here: each call's arguments are their text as generated (the stream's
pieces joined), and a call cut short (max_tokens, a stop string) keeps the arguments it had.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')
"""A call up to its arguments: matched only once all of it is there (the name's closing
quote and the key after it), so a partial text never opens a call early."""
_SPACE = " \t\n\r"
_NEXT = {("[", "["): "{", ("}", "}"): ",", (",", ","): "{", (",", "]"): ""}
"""(what was expected, the character that came) -> what is expected next."""
_SCALAR_END = ",}]" + _SPACE


@dataclass
class ArrayCall:
    """One call of the array: its function name and where its arguments lie in the text."""

    name: str
    start: int | None = None
    """Where its arguments' text begins; None until their first character came."""
    end: int | None = None
    """Where it ends; None while it is still generated (or was cut short)."""

    def arguments(self, text: str) -> str:
        """Its arguments' text, as far as ``text`` holds it."""
        return "" if self.start is None else text[self.start:self.end]


class CallArrayReader:
    """Reads the calls out of a forced call array, fed the whole text so far each time (it
    only grows); each character is looked at once. Text that does not follow the array's
    shape stops the reading: the calls read before it stay."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        """The functions offered: a call of any other is read past, never returned (the
        grammar allows none)."""
        self.calls: list[ArrayCall] = []
        self._at = 0
        self._expect = "["
        """What comes next: "[" (the array), "{" (a call), "value" (its arguments' first
        character), "arguments" (inside them), "}" (the call's end) or "," (another call,
        or "]"); "" once the array ended or the text left its shape."""
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> list[ArrayCall]:
        """Read what ``text`` adds to the text fed before; returns every call of an offered
        function whose arguments began."""
        while self._expect and self._at < len(text):
            if self._expect == "arguments":
                self._read_arguments(text)
                continue
            if self._expect == "{":
                if not self._read_head(text):
                    break  # the head is not all there yet
                continue
            char = text[self._at]
            if char in _SPACE:
                self._at += 1
            elif self._expect == "value":
                self.calls[-1].start = self._at
                self._expect = "arguments"
            elif (self._expect, char) in _NEXT:
                self._expect = _NEXT[self._expect, char]
                self._at += 1
            else:
                self._expect = ""  # not the array's shape: nothing more is read
        return [call for call in self.calls
                if call.start is not None and call.name in self.names]

    def _read_head(self, text: str) -> bool:
        head = _CALL_HEAD.match(text, self._at)
        if head is None:  # not all there yet (the grammar allows nothing else)
            return False
        self.calls.append(ArrayCall(json.loads(head.group(1))))
        self._at = head.end()
        self._expect = "value"
        return True

    def _read_arguments(self, text: str) -> None:
        """Through the arguments' value: an object or array to its matching bracket, a
        string to its closing quote, a number or literal to the character after it."""
        start = self.calls[-1].start
        assert start is not None
        scalar = text[start] not in '{["'
        while self._at < len(text):
            char = text[self._at]
            if scalar:
                if char in _SCALAR_END:
                    self._end_arguments()
                    return
            elif self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                    if self._depth == 0:  # the value was this string
                        self._at += 1
                        self._end_arguments()
                        return
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._at += 1
                    self._end_arguments()
                    return
            self._at += 1

    def _end_arguments(self) -> None:
        self.calls[-1].end = self._at
        self._expect = "}"
