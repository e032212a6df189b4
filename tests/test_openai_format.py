"""ResponseFormatter with non-finite logprobs (an engine may report -inf for a token its
sampling made impossible): every object it builds is strict JSON, -inf and NaN reported as
OpenAI's -9999.0; and forced tool calls cut at max_tokens. The tiny model's real tokenizer
decodes the tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.protocol import StreamChunk
from gateway.logprob_format import LOGPROB_FLOOR
from gateway.openai_format import Endpoint, PromptEcho, ResponseFormatter
from gateway.token_bytes import TokenBytes
from gateway.tool_calls import Function, ToolPlan


def _chunk(tokenizer: Any) -> StreamChunk:
    """Two tokens (a, b), each with two alternatives, all decoding to distinct strings."""
    a, b, c, d, e, f = tokenizer.convert_tokens_to_ids(list("abcdef"))
    return StreamChunk("r", [a, b], "ab", prompt_tokens=3, completion_tokens=2,
                       finish_reason="length",
                       logprobs=[{a: float("-inf"), c: float("nan"), d: -1.5},
                                 {b: -0.25, e: float("inf"), f: float("-inf")}])


def _strict(payload: dict[str, Any]) -> Any:
    """Serialise as the SSE encoder does, and parse back refusing NaN / Infinity."""
    def refuse(literal: str) -> Any:
        raise ValueError(f"not JSON: {literal}")
    return json.loads(json.dumps(payload, allow_nan=False), parse_constant=refuse)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_non_finite_logprobs_come_out_as_finite_json(tiny_model_dir: Path,
                                                     endpoint: Endpoint) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    streamed = ResponseFormatter(endpoint, "m", tokenizer, 3)
    events = [_strict(e) for e in streamed.stream_events(_chunk(tokenizer),
                                                         usage="last_chunk")]
    whole = ResponseFormatter(endpoint, "m", tokenizer, 3)
    whole.add(_chunk(tokenizer))
    final = _strict(whole.final())
    logprobs = final["choices"][0]["logprobs"]
    assert events[-1]["choices"][0]["logprobs"] == logprobs
    if endpoint == "chat":
        chosen = [t["logprob"] for t in logprobs["content"]]
        tops = [[t["logprob"] for t in step["top_logprobs"]] for step in logprobs["content"]]
    else:
        chosen = logprobs["token_logprobs"]
        tops = [sorted(step.values(), reverse=True) for step in logprobs["top_logprobs"]]
    assert chosen == [LOGPROB_FLOOR, -0.25]
    # NaN and +inf are not logprobs at all: reported as the floor too.
    assert tops == [[-1.5, LOGPROB_FLOOR, LOGPROB_FLOOR], [-0.25, LOGPROB_FLOOR, LOGPROB_FLOOR]]


def test_token_bytes_are_the_vocabulary_bytes(tiny_model_dir: Path) -> None:
    """Byte-level BPE: each token's bytes joined give the text's UTF-8, also where a token
    holds part of a character and decodes alone to U+FFFD."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    token_bytes = TokenBytes(tokenizer)
    partial = 0
    for text in ("naïve café", "emoji 😀 and 日本語", "plain words"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(i) for i in ids) == text.encode()
        partial += sum("\ufffd" in tokenizer.decode([i]) for i in ids)
    assert partial > 0  # the case that encoding decoded text would get wrong
    eos = tokenizer.eos_token_id
    assert token_bytes(eos) == str(tokenizer.eos_token).encode()  # special: its text
    assert token_bytes(len(tokenizer) + 10) == b""


def _chunks(text: str, finish: str, stop_reason: str | None = None) -> list[StreamChunk]:
    """``text`` as engine chunks of 3 characters, the last with the finish."""
    pieces = [text[at:at + 3] for at in range(0, len(text), 3)]
    return [StreamChunk("r", [5], piece, 3, i + 1, finish if i == len(pieces) - 1 else None,
                        stop_reason=stop_reason if i == len(pieces) - 1 else None)
            for i, piece in enumerate(pieces)]


def _formatter(tokenizer: Any, tools: ToolPlan) -> ResponseFormatter:
    formatter = ResponseFormatter("chat", "m", tokenizer, None, tools=tools)
    formatter.start([PromptEcho([1, 2, 3])])
    return formatter


def _whole(tokenizer: Any, tools: ToolPlan, chunks: list[StreamChunk]) -> dict[str, Any]:
    """The whole response's choice of the same chunks."""
    formatter = _formatter(tokenizer, tools)
    for chunk in chunks:
        formatter.add(chunk)
    [choice] = formatter.final()["choices"]
    return choice


def _streamed(tokenizer: Any, tools: ToolPlan, chunks: list[StreamChunk]
              ) -> tuple[list[dict[str, Any]], str, list[dict[str, str]], list[str]]:
    """A chat stream's choice deltas, its content joined, its calls joined (by index), and
    the arguments each call opened with."""
    formatter = _formatter(tokenizer, tools)
    deltas = [e["choices"][0] for chunk in chunks
              for e in formatter.stream_events(chunk, usage="none")]
    calls: dict[int, dict[str, str]] = {}
    opened_with: list[str] = []
    for delta in deltas:
        for call in delta["delta"].get("tool_calls") or []:
            if "id" in call:
                calls[call["index"]] = dict(call["function"])
                opened_with.append(call["function"]["arguments"])
            else:
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    return deltas, content, [calls[i] for i in sorted(calls)], opened_with


@pytest.mark.parametrize("ending", ["whole", "length", "stop string"])
def test_required_calls_stream_their_arguments_as_generated(tiny_model_dir: Path,
                                                            ending: str) -> None:
    # tool_choice "required": the answer is an array of calls. Each call opens once its
    # arguments begin, and they follow as generated; joined, the stream's calls are the
    # whole response's (an output cut at max_tokens keeps the call it cut, with its arguments
    # so far, and stays "length"; one a stop string cut stays "stop", not "tool_calls").
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tools = ToolPlan((Function("add", None, {"type": "object"}),
                      Function("neg", None, {"type": "object"})), "required")
    text = '[{"name": "add", "arguments": {"a": 1, "s": "}]\\""}}, ' \
           '{"name": "neg", "arguments": {"x": 2}}]'
    if ending != "whole":
        text = text[:text.index('"x"') + 3]
    finish, stop_reason = "length" if ending == "length" else "stop", \
        ": " if ending == "stop string" else None
    chunks = _chunks(text, finish, stop_reason)
    deltas, content, streamed_calls, opened_with = _streamed(tokenizer, tools, chunks)
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}  # the role alone
    assert content == ""
    for delta in deltas[1:-1]:  # calls only, never content
        assert delta["delta"]["content"] is None and delta["finish_reason"] is None
        assert delta["delta"]["tool_calls"]
    assert deltas[-1] == {"index": 0, "delta": {}, "logprobs": None,
                          "stop_reason": stop_reason,
                          "finish_reason": "tool_calls" if ending == "whole" else finish}
    assert all(len(first) <= 3 for first in opened_with)  # opened before their ends came
    choice = _whole(tokenizer, tools, chunks)
    assert choice["finish_reason"] == deltas[-1]["finish_reason"]
    assert choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == streamed_calls == [
        {"name": "add", "arguments": '{"a": 1, "s": "}]\\""}'},
        {"name": "neg", "arguments": '{"x": 2}' if ending == "whole" else '{"x"'}]
    # Cut before any call's arguments began: no call, and the array is never content.
    choice = _whole(tokenizer, tools, [
        StreamChunk("r", [5], '[{"name": "add", "', 3, 1, "stop", stop_reason="x")])
    assert choice["message"] == {"role": "assistant", "content": None}
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_strict_auto_calls_stream_their_arguments_as_generated(tiny_model_dir: Path,
                                                               finish: str) -> None:
    # auto with a strict function: every call block is held to its shape, so its call
    # opens once its arguments begin and they follow as generated; the content before the
    # first block streams as it comes, the rest of it comes at the end.
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tools = ToolPlan((Function("add", None, {"type": "object"}, strict=True),
                      Function("neg", None, {"type": "object"})), "auto")
    text = ('Let me check. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
            '<tool_call>\n{"name": "neg", "arguments": {"x": "}<tool_call>"}}\n</tool_call>'
            ' Done.  ')
    if finish == "length":
        text = text[:text.index('"x"') + 3]
    chunks = _chunks(text, finish)
    deltas, content, calls, opened_with = _streamed(tokenizer, tools, chunks)
    assert all(len(first) <= 3 for first in opened_with)  # opened before their ends came
    first_call = next(i for i, d in enumerate(deltas) if d["delta"].get("tool_calls"))
    assert "".join(d["delta"].get("content") or "" for d in deltas[:first_call]) == \
        "Let me check. "
    assert deltas[-1]["finish_reason"] == ("tool_calls" if finish == "stop" else "length")
    choice = _whole(tokenizer, tools, chunks)
    assert choice["finish_reason"] == deltas[-1]["finish_reason"]
    assert choice["message"]["content"] == content == (
        "Let me check. \n Done." if finish == "stop" else "Let me check. ")
    assert [c["function"] for c in choice["message"]["tool_calls"]] == calls == [
        {"name": "add", "arguments": '{"a": 1}'},
        {"name": "neg", "arguments": '{"x": "}<tool_call>"}' if finish == "stop" else '{"x"'}]


@pytest.mark.parametrize(("text", "content"), [
    ('Let me check. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n',
     "Let me check. "),
    ('First. <tool_call>{"name": "add", "arguments": {}}</tool_call> then more.  ',
     "First.  then more."),
    ('<tool_call>{"name": "add", "arguments": {}}</tool_call>', ""),
    ('{"a": 1} <tool_call>{"name": "add", "arguments": {}}</tool_call>', '{"a": 1} ')])
@pytest.mark.parametrize("size", [3, 9, 1000])  # the last: all of it with the finish
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_auto_calls_leave_the_same_content_streamed_or_whole(tiny_model_dir: Path,
                                                             text: str, content: str,
                                                             size: int, finish: str) -> None:
    # The text before the first call as it came (vLLM's content; a stream may have sent
    # it already), what lies outside the calls after it less trailing whitespace. Cut at
    # max_tokens after its blocks closed, the same calls and content, finish "length".
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tools = ToolPlan((Function("add", None, {"type": "object"}),), "auto")
    chunks = [StreamChunk("r", [5], text[i:i + size], 3, i + 1,
                          finish if i + size >= len(text) else None)
              for i in range(0, len(text), size)]
    streamed = _formatter(tokenizer, tools)
    deltas = [e["choices"][0]["delta"] for chunk in chunks
              for e in streamed.stream_events(chunk, usage="none")]
    choice = _whole(tokenizer, tools, chunks)
    sent = "".join(d.get("content") or "" for d in deltas)
    assert (choice["message"]["content"] or "") == sent
    assert sent == content
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add"]
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or []] == [
        "add"]
    assert choice["finish_reason"] == ("tool_calls" if finish == "stop" else "length")


def test_text_offsets_index_the_text_where_characters_span_tokens(
        tiny_model_dir: Path) -> None:
    """Streamed one token per chunk (as the engine emits text: a character once complete)
    and whole, with and without the echoed prompt: each offset points into the text, the
    text between two offsets is what those tokens spell, and a token that holds only part
    of a character begins where the character will."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    prompt_text, text = "naïve café", "emoji 😀 and 日本語"
    prompt_ids = tokenizer.encode(prompt_text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert sum("\ufffd" in tokenizer.decode([i]) for i in ids) > 1  # split characters
    decoded = IncrementalDetokenizer(tokenizer, (), True)
    chunks = []
    for n, token_id in enumerate(ids, 1):
        decoded.add_tokens([token_id])
        chunks.append(StreamChunk("r", [token_id], decoded.take_delta(n == len(ids)),
                                  prompt_tokens=len(prompt_ids), completion_tokens=n,
                                  finish_reason="length" if n == len(ids) else None,
                                  logprobs=[{token_id: -1.0}]))
    for echo in (False, True):
        streamed, whole = (ResponseFormatter("completions", "m", tokenizer, 0, echo=echo)
                           for _ in range(2))
        for fmt in (streamed, whole):
            fmt.start([PromptEcho(prompt_ids, prompt_text)])
        events = [e for c in chunks for e in streamed.stream_events(c, usage="none")]
        for chunk in chunks:
            whole.add(chunk)
        choice = whole.final()["choices"][0]
        offsets = choice["logprobs"]["text_offset"]
        assert offsets == [o for e in events if e["choices"]
                           for o in e["choices"][0]["logprobs"]["text_offset"]]
        full = choice["text"]
        assert full == (prompt_text if echo else "") + text
        run = list(prompt_ids if echo else []) + ids
        assert len(offsets) == len(run) and offsets == sorted(offsets)
        spelled = [full[a:b] for a, b in zip(offsets, [*offsets[1:], len(full)], strict=True)]
        assert "".join(spelled) == full
        # Each token is named by what it spells there, as vLLM names them: a part of a
        # character by "", the token completing it by the whole character; streamed alike
        # (a special token, left out of the text, keeps its own name).
        special = set(tokenizer.all_special_ids)
        names = choice["logprobs"]["tokens"]
        assert [name for name, i in zip(names, run, strict=True) if i not in special] == \
            [piece for piece, i in zip(spelled, run, strict=True) if i not in special]
        assert [t for e in events if e["choices"]
                for t in e["choices"][0]["logprobs"]["tokens"]] == names
        assert "\ufffd" not in "".join(names)
        base = len(prompt_text) if echo else 0
        for k, offset in enumerate(offsets[-len(ids):]):
            before = str(tokenizer.decode(ids[:k]))  # where token k begins, once complete
            if not before.endswith("\ufffd"):
                assert offset == base + len(before)
