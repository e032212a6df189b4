"""One chat choice's tool calls as stream deltas, sent as they are generated (as OpenAI and
vLLM stream a call's arguments) where a grammar holds their shape: a named tool_choice's
one call (all of the text is its arguments), and the calls a call reader finds
(gateway/call_readers.py: ``required``'s array, ``auto``'s held blocks). The first delta
of a call opens it (its id, name and the arguments so far); each later one adds to its
arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.call_readers import CallArrayReader, CallBlockReader
from gateway.tool_calls import ToolPlan


@dataclass
class CallDeltas:
    """The calls of one choice's stream so far."""

    tools: ToolPlan
    reader: CallArrayReader | CallBlockReader | None = None
    opened: int = 0
    """The calls opened (their id and name sent)."""
    arguments_sent: int = 0
    """Where in the choice's text the arguments sent end."""

    def named(self, text: str) -> list[dict[str, Any]]:
        """A named tool_choice's call: ``text`` (the output so far) is its arguments."""
        new = text[self.arguments_sent:]
        self.arguments_sent = len(text)
        if not new:
            return []
        if not self.opened:
            self.opened = 1
            return [{"index": 0, **self.tools.named_call(new)}]
        return [{"index": 0, "function": {"arguments": new}}]

    def read(self, text: str) -> list[dict[str, Any]]:
        """The calls a reader finds in ``text`` (the output so far): each opens once its
        arguments begin."""
        if self.reader is None:
            self.reader = self.tools.call_reader()
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(self.reader.feed(text)):
            if index < self.opened - 1:
                continue  # whole, and sent
            assert call.start is not None
            upto = len(text) if call.end is None else call.end
            piece = text[max(call.start, self.arguments_sent):upto]
            self.arguments_sent = upto
            if index == self.opened:
                self.opened += 1
                deltas.append({"index": index, **self.tools.named_call(piece, call.name)})
            elif piece:
                deltas.append({"index": index, "function": {"arguments": piece}})
        return deltas
