"""A chat stream's events as the Responses API's: ``response.created`` and
``response.in_progress`` first; for the message, ``output_item.added``,
``content_part.added``, an ``output_text.delta`` per piece of content (with its tokens'
logprobs when asked), ``output_text.done``, ``content_part.done``, ``output_item.done``;
then for each call ``output_item.added``, ``function_call_arguments.delta`` (a call a
grammar holds as its arguments are generated, others whole) / ``.done``, ``output_item.done``;
last ``response.completed`` (or ``response.incomplete`` when cut at max_output_tokens) with
the whole response and its usage. A call's item opens as soon as its first delta comes,
closing the message before it (whose text is all told); content after a call streamed as
generated (held back to the end by the chat stream) is a message item after the calls,
where a whole response puts all content in one message before its calls. Every event
carries its ``type`` and a ``sequence_number``
counting from 0, and is sent as a named SSE event (``event: <type>``); there is no
``[DONE]``, as OpenAI sends none for this API.

The chat path's stream (gateway/openai_stream.py) is the source: it holds back text that may
be a call and sends whole auto calls at the end, and with ``include_usage`` (which the
translated request asks for) ends with a usage event. An engine failure there (its
``error`` event) becomes an ``error`` event, then ``response.failed``. The translator only
reads what the chat stream yields: closing the response (a client that hangs up) closes the
chat stream beneath, which aborts the engine request as a chat stream's hang-up does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any

from gateway.openai_stream import sse_event
from gateway.responses_format import (
    ResponseEcho,
    call_status,
    ended_status,
    function_call_item,
    message_item,
    new_id,
    output_text,
    usage,
)
from gateway.responses_protocol import as_named_here

FAILURE_CODES = {"rate_limit_error": "rate_limit_exceeded",
                 "invalid_request_error": "invalid_prompt"}
"""A chat error's type -> the code of a failed response's error (OpenAI's few codes; the
error event before it carries the chat error's own code)."""
STREAM_FAILED = {"message": "the response stream ended before its last event",
                 "code": "engine_error"}


class ResponseEvents:
    """The Responses events of one request's chat stream (see the module docstring)."""

    def __init__(self, echo: ResponseEcho) -> None:
        self.echo = echo
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        """Items in output order; each is replaced by its final form once done."""
        self.message: int | None = None
        """The open message item's output index."""
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.unsent: list[dict[str, Any]] = []
        """Logprobs that came with no text yet (they go with the next delta)."""
        self.finish: str | None = None
        self.open_call: int | None = None
        """The output index of the call being told as its arguments come."""
        self.ended = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        # Numbered when told (told()), not when made: a stream cut between two events of
        # one chat chunk numbers its closing events on from the last one it sent.
        return {"type": kind, "sequence_number": None, **fields}

    def told(self, event: dict[str, Any]) -> bytes:
        """The event as a named SSE event, numbered next."""
        event["sequence_number"] = self.sequence
        self.sequence += 1
        return sse(event)

    def opening(self) -> list[dict[str, Any]]:
        response = self.echo.response("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def on_chat(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat stream payload (a chunk, the usage, or an error)."""
        if self.ended:
            return []
        if "error" in payload:
            return self.failed(payload["error"])
        events: list[dict[str, Any]] = []
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            self.unsent += (choice.get("logprobs") or {}).get("content") or []
            calls = delta.get("tool_calls") or []
            if self.open_call is not None:
                # A call told as generated: the delta's content is what follows its block
                # (else content comes before the calls of its delta, as in the text).
                for call in calls:
                    events += self._call_delta(call)
                calls = []
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in calls:
                events += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
                events += self._close_message() + self._close_call()
        if payload.get("usage") and not payload.get("choices"):
            events += self._completed(payload["usage"])
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat tool-call delta. One that opens a call (it has an id) is an item told at
        once, the message or call before it ended (its text is all told: the chat stream
        holds back what may be a call); the others add to the open call's arguments as they
        come (a call a grammar holds streams them as generated, others come whole)."""
        name, piece = call["function"].get("name"), call["function"]["arguments"]
        if "id" not in call and self.open_call is not None:
            return self._arguments_delta(piece)
        return self._close_message() + self._close_call() + self._open_call(name or "", piece)

    def _open_message(self) -> list[dict[str, Any]]:
        if self.message is not None:
            return []
        self.message = len(self.output)
        item = message_item(new_id("msg"), "in_progress", [])
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=self.message,
                            item=item),
                self._event("response.content_part.added", **self._where(),
                            part=output_text("", []))]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = self._close_call() + self._open_message()  # text after a call: it ended
        self.text.append(text)
        self.logprobs += self.unsent
        events.append(self._event("response.output_text.delta", **self._where(), delta=text,
                                  logprobs=self.unsent))
        self.unsent = []
        return events

    def _where(self) -> dict[str, Any]:
        assert self.message is not None
        return {"item_id": self.output[self.message]["id"], "output_index": self.message,
                "content_index": 0}

    def _close_message(self) -> list[dict[str, Any]]:
        if self.message is None:
            return []
        where, text = self._where(), "".join(self.text)
        logprobs, self.text, self.logprobs = self.logprobs + self.unsent, [], []
        self.unsent = []
        part = output_text(text, logprobs)
        item = message_item(where["item_id"], ended_status(self.finish), [part])
        self.output[self.message] = item
        self.message = None
        return [self._event("response.output_text.done", **where, text=text,
                            logprobs=logprobs),
                self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=item)]

    def _open_call(self, name: str, arguments: str) -> list[dict[str, Any]]:
        index = len(self.output)
        item_id, call_id = new_id("fc"), new_id("call")
        self.output.append(function_call_item(item_id, call_id, name, "", "in_progress"))
        self.open_call = index
        return [self._event("response.output_item.added", output_index=index,
                            item=dict(self.output[index])),  # as it is now: it grows
                *self._arguments_delta(arguments)]

    def _arguments_delta(self, piece: str) -> list[dict[str, Any]]:
        assert self.open_call is not None
        if not piece:
            return []
        item = self.output[self.open_call]
        item["arguments"] += piece
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self.open_call, delta=piece)]

    def _close_call(self) -> list[dict[str, Any]]:
        if self.open_call is None:
            return []
        index, item = self.open_call, self.output[self.open_call]
        self.open_call = None
        arguments = item["arguments"]
        self.output[index] = function_call_item(item["id"], item["call_id"], item["name"],
                                                arguments, call_status(arguments))
        return [self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, name=item["name"], arguments=arguments),
                self._event("response.output_item.done", output_index=index,
                            item=self.output[index])]

    def _completed(self, chat_usage: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if not self.output:  # nothing said and no call: an empty message, as a whole one
            events += self._open_message() + self._close_message()
        self.ended = True
        status = ended_status(self.finish)
        response = self.echo.response(status, self.output, usage(chat_usage))
        return [*events, self._event(f"response.{status}", response=response)]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An error event with the chat stream's own error, then response.failed with the
        output so far."""
        self.ended = True
        if self.message is not None:  # what it said before the failure, marked so
            item = self.output[self.message]
            self.output[self.message] = {**item, "status": "incomplete", "content": [
                output_text("".join(self.text), self.logprobs + self.unsent)]}
        if self.open_call is not None:  # a call cut by the failure: its arguments so far
            self.output[self.open_call] = {**self.output[self.open_call],
                                           "status": "incomplete"}
        message = str(error.get("message") or "the request failed")
        code, param = error.get("code"), error.get("param")
        if isinstance(param, str):
            param, message = as_named_here(param, message)
        failure = {"code": FAILURE_CODES.get(str(error.get("type")), "server_error"),
                   "message": message}
        return [self._event("error", code=code, message=message,
                            param=param if isinstance(param, str) else None),
                self._event("response.failed", response=self.echo.response(
                    "failed", self.output, error=failure))]

    def closing(self, error: dict[str, Any] = STREAM_FAILED) -> list[dict[str, Any]]:
        """The events owed when the chat stream ended without a last event (none if it
        had one), failing with ``error``: the client must not take a cut stream for a
        finished one."""
        return [] if self.ended else self.failed(error)

    def cut_tail(self, error_body: dict[str, Any]) -> bytes:
        """The end of this stream when the server cuts it (ShutdownCutoff's CUT_TAIL_KEY):
        the closing events, failing with the error of ``error_body``."""
        return b"".join(self.told(event) for event in self.closing(error_body["error"]))


def sse(event: dict[str, Any]) -> bytes:
    """One named SSE event."""
    return b"event: " + event["type"].encode() + b"\n" + sse_event(event)


def chat_payloads(raw: bytes | str | memoryview) -> list[dict[str, Any]]:
    """The JSON payloads of what the chat stream yielded (``data:`` lines; not [DONE])."""
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    payloads = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            payloads.append(json.loads(line[6:]))
    return payloads


async def response_events(chat: AsyncIterable[bytes | str | memoryview],
                          events: ResponseEvents) -> AsyncGenerator[bytes, None]:
    """The Responses SSE stream of a chat SSE stream, told as ``events`` (new)."""
    for event in events.opening():
        yield events.told(event)
    async for raw in chat:
        for payload in chat_payloads(raw):
            for event in events.on_chat(payload):
                yield events.told(event)
    for event in events.closing():
        yield events.told(event)
