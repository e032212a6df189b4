"""The Responses stream translator on its own (gateway/responses_stream.py): how a chat
stream that ends short, or a stream the server cuts, still ends as a failed response with
every event numbered in order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from gateway.responses_format import ResponseEcho
from gateway.responses_stream import ResponseEvents, response_events
from gateway.shutdown_cutoff import MESSAGE, SHUTTING_DOWN

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
