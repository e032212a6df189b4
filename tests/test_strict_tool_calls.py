"""OpenAI's ``strict`` on a function under tool_choice auto: the model may answer in text or
call, but a call block it opens must name a known function and carry arguments that match a
strict function's parameters (vLLM does the same with structural tags). Checked on xgrammar's
own matcher over the tokenizer's real tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import xgrammar
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.structured_output import GrammarCompiler
from gateway.openai_chat_protocol import ChatCompletionRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}


def request(strict: bool | None, parallel: bool = True, **extra: Any) -> ChatCompletionRequest:
    weather: dict[str, Any] = {"name": "weather", "parameters": WEATHER}
    if strict is not None:
        weather["strict"] = strict
    return ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": weather},
                  {"type": "function", "function": {"name": "note", "parameters": {
                      "type": "object"}}}],
        "parallel_tool_calls": parallel, **extra})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def accepts(tokenizer: PreTrainedTokenizerBase, request: ChatCompletionRequest,
            text: str) -> bool:
    """Whether the request's constraint lets the model write ``text`` and then stop."""
    constraint = request.structured_constraint()
    assert constraint is not None
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    matcher = xgrammar.GrammarMatcher(compiler.compile(constraint))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(
        tokenizer.eos_token_id)


def test_only_strict_functions_constrain_auto() -> None:
    for strict in (None, False):
        assert request(strict).structured_constraint() is None
    constraint = request(True).structured_constraint()
    assert constraint is not None and constraint.kind == "structural_tag"


CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'


@pytest.mark.parametrize("text, allowed", [
    ("It is sunny in Paris today.", True),  # text alone
    ("Let me look. " + CALL, True),
    (CALL.replace("<tool_call>", "<tool_call>\n").replace("}</", "}\n</"), True),
    (CALL + " " + CALL.replace("Paris", "Rome"), True),  # parallel calls
    ('<tool_call>{"name": "note", "arguments": {"any": ["thing"]}}</tool_call>', True),
    (CALL.replace("3", '"three"'), False),  # a strict function's arguments hold
    (CALL.replace(', "days": 3', ""), False),  # its required parameters too
    (CALL.replace('"days": 3', '"days": 3, "extra": 1'), False),
    (CALL.replace("weather", "unknown"), False),  # only known functions
])
def test_call_blocks_under_strict_auto(tokenizer: PreTrainedTokenizerBase, text: str,
                                       allowed: bool) -> None:
    assert accepts(tokenizer, request(True), text) is allowed


def test_one_call_when_calls_are_not_parallel(tokenizer: PreTrainedTokenizerBase) -> None:
    assert accepts(tokenizer, request(True, parallel=False), CALL)
    assert not accepts(tokenizer, request(True, parallel=False), CALL + " " + CALL)


def test_strict_functions_take_no_second_constraint() -> None:
    with pytest.raises(ValueError, match="strict function"):
        request(True, response_format={"type": "json_object"})
