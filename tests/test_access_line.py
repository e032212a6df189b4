"""The access line: what a request's record says, with the client's own text (the path, the
end user's id) made printable so that no client can forge a line; and the status of a
response its client left half-way."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.access_log import AccessLog, AccessRecord, access_line


def test_the_line_names_the_end_user_without_letting_it_forge_a_line() -> None:
    record = AccessRecord(start=10.0, tenant="acme", adapter="bot", prompt_tokens=3,
                          completion_tokens=2, first_token_at=10.5, end_user="u 1\nGET / 200")
    line = access_line("POST", "/v1/completions", 200, record, now=11.0)
    assert line == ("POST /v1/completions 200 tenant=acme adapter=bot prompt_tokens=3 "
                    "completion_tokens=2 ttft_ms=500.0 duration_ms=1000.0 "
                    "user=u\\x201\\x0aGET\\x20/\\x20200")
    assert "\n" not in line
    both = AccessRecord(start=0.0, end_user="u1", safety_identifier="s1")
    assert access_line("POST", "/v1/chat/completions", 200, both, now=0.001).endswith(
        " user=u1 safety_identifier=s1")  # the one does not hide the other


def test_a_request_without_an_end_user_has_no_user_field() -> None:
    line = access_line("GET", "/health", 200, AccessRecord(start=0.0), now=0.001)
    assert line == ("GET /health 200 tenant=- adapter=- prompt_tokens=- completion_tokens=- "
                    "ttft_ms=- duration_ms=1.0")


def _run(app: ASGIApp, disconnect: bool, sent: list[Message] | None = None
         ) -> tuple[list[int], list[str]]:
    """Drive AccessLog around ``app`` for one GET; returns what observe saw and the lines
    (and leaves what was sent to the client in ``sent``)."""
    seen: list[int] = []
    lines: list[str] = []
    sent = [] if sent is None else sent

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    async def receive() -> Message:
        if disconnect:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    handler = Catch()
    logger = logging.getLogger("loragate.access")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        scope = {"type": "http", "method": "GET", "path": "/v1/x", "headers": []}
        asyncio.run(AccessLog(app, lambda _, status: seen.append(status))(scope, receive, send))
    except RuntimeError:
        seen.append(-1)  # the app raised (after AccessLog saw it): marked last
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return seen, lines


def test_a_stream_its_client_left_is_logged_as_closed_not_as_its_200() -> None:
    async def stream(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        if (await receive())["type"] == "http.disconnect":
            return  # as a streaming response does when its client goes away
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    seen, lines = _run(stream, disconnect=True)
    assert seen == [0] and lines[0].startswith("GET /v1/x 499 ")
    done = StreamingResponse(iter([b"a", b"b"]))
    seen, lines = _run(done, disconnect=False)
    assert seen == [200] and lines[0].startswith("GET /v1/x 200 ")


def test_a_crash_is_a_500_with_a_request_id_that_tells_nothing_of_it(
        caplog: pytest.LogCaptureFixture) -> None:
    async def crash(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("boom /secret/path")

    sent: list[Message] = []
    with caplog.at_level(logging.ERROR, logger="gateway.access_log"):
        seen, lines = _run(crash, disconnect=False, sent=sent)
    assert seen == [500] and lines[0].startswith("GET /v1/x 500 ")
    assert sent[0]["status"] == 500
    ids = [value.decode() for name, value in sent[0]["headers"] if name == b"x-request-id"]
    assert len(ids) == 1 and lines[0].endswith(f" request_id={ids[0]}")
    assert json.loads(sent[1]["body"]) == {"error": {
        "message": "internal error", "type": "server_error", "param": None, "code": None}}
    assert "boom /secret/path" in caplog.text  # the operator's log has it, with its traceback
    # Once the response started, it can only be cut: the server's middleware does that.
    async def crash_mid_way(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("boom")

    seen, lines = _run(crash_mid_way, disconnect=False)
    assert seen == [200, -1] and lines[0].startswith("GET /v1/x 200 ")


def test_every_response_has_a_request_id_and_the_line_names_it() -> None:
    """A route's own id is kept; a response without one (a refusal, an error) gets one."""
    for given in ([(b"x-request-id", b"gw-route")], []):
        async def answer(scope: Scope, receive: Receive, send: Send,
                         given: list[tuple[bytes, bytes]] = given) -> None:
            await send({"type": "http.response.start", "status": 404, "headers": given})
            await send({"type": "http.response.body", "body": b"{}"})

        sent: list[Message] = []
        _, lines = _run(answer, disconnect=False, sent=sent)
        ids = [value.decode() for name, value in sent[0]["headers"] if name == b"x-request-id"]
        assert len(ids) == 1 and ids[0].startswith("gw-")
        assert ids[0] == "gw-route" or not given
        assert lines[0].endswith(f" request_id={ids[0]}"), lines
