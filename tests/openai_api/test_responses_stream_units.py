"""The Responses stream translator on its own (gateway/responses_stream.py): how a chat
stream that ends short, or a stream the server cuts, still ends as a failed response with
every event numbered in order; and calls streamed as generated become items in text order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.protocol import StreamChunk
from gateway.openai_format import PromptEcho, ResponseFormatter
from gateway.responses_format import ResponseEcho
from gateway.responses_stream import ResponseEvents, response_events
from gateway.shutdown_cutoff import MESSAGE, SHUTTING_DOWN
from gateway.tool_calls import Function, ToolPlan

TEXT_CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'


def _parsed(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(block.split(b"\ndata: ")[1]) for block in raw.split(b"\n\n") if block]


def test_a_chat_stream_cut_short_ends_as_a_failed_response() -> None:
    """The translator never lets a stream end without a last event (a chat stream that
    stops short): the client must not take it for a finished one."""

    async def cut() -> AsyncIterator[bytes]:
        yield TEXT_CHUNK

    async def run() -> list[dict[str, Any]]:
        echo = ResponseEcho("resp_1", 0, {"model": "m"})
        return [json.loads(raw.split(b"\ndata: ")[1]) async for raw in
                response_events(cut(), ResponseEvents(echo))]

    events = asyncio.run(run())
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hi"


def test_a_stream_cut_between_two_events_of_a_chunk_numbers_its_end_on_from_what_it_sent(
        ) -> None:
    async def chat() -> AsyncIterator[bytes]:
        yield TEXT_CHUNK
        await asyncio.sleep(3600)

    async def run() -> list[dict[str, Any]]:
        events = ResponseEvents(ResponseEcho("resp_1", 0, {"model": "m"}))
        stream = response_events(chat(), events)
        sent = []
        async for raw in stream:  # the first text chunk makes several events: stop at one
            sent += _parsed(raw)
            if sent[-1]["type"] == "response.output_item.added":
                break
        await stream.aclose()  # the server's cut lands here
        error = {"error": {"message": MESSAGE, "code": SHUTTING_DOWN}}
        return sent + _parsed(events.cut_tail(error))

    events = asyncio.run(run())
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "error",
        "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(5))


@pytest.mark.parametrize("before", ["", "Let me check. "])
def test_strict_auto_calls_are_items_in_text_order(tiny_model_dir: Path, before: str) -> None:
    # A call streamed as generated opens its item at once (closing the message of the
    # content before its block, if any), and the content after its block comes as a message
    # after it: items in text order, each call's arguments told as generated.
    tools = ToolPlan((Function("add", None, {"type": "object"}, strict=True),), "auto")
    text = f'{before}<tool_call>{{"name": "add", "arguments": {{"a": 1}}}}</tool_call> Done.'
    pieces = [text[at:at + 4] for at in range(0, len(text), 4)]
    formatter = ResponseFormatter("chat", "m", AutoTokenizer.from_pretrained(
        str(tiny_model_dir)), None, tools=tools)
    formatter.start([PromptEcho([1, 2, 3])])
    events = ResponseEvents(ResponseEcho("resp_1", 0, {"model": "m"}))
    told = events.opening()
    for i, piece in enumerate(pieces):
        chunk = StreamChunk("r", [5], piece, 3, i + 1, "stop" if i == len(pieces) - 1 else None)
        for payload in formatter.stream_events(chunk, usage="last_chunk"):
            told += events.on_chat(payload)
    told += events.on_chat(formatter.usage_event())
    kinds = [e["type"] for e in told if not e["type"].endswith(".delta")]
    call_events = ["response.output_item.added", "response.function_call_arguments.done",
                   "response.output_item.done"]
    message_events = ["response.output_item.added", "response.content_part.added",
                      "response.output_text.done", "response.content_part.done",
                      "response.output_item.done"]
    leading = message_events if before else []
    assert kinds == ["response.created", "response.in_progress", *leading, *call_events,
                     *message_events, "response.completed"]
    output = told[-1]["response"]["output"]
    assert [item["type"] for item in output] == \
        ["message"] * bool(before) + ["function_call", "message"]
    assert [item["content"][0]["text"] for item in output if item["type"] == "message"] == \
        [before] * bool(before) + [" Done."]
    assert output[-2]["arguments"] == '{"a": 1}' and output[-2]["status"] == "completed"
    deltas = [e for e in told if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # told as generated
