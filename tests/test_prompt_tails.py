"""Truncated prompts are tokenized from their tail only when that provably gives the same ids
(a client cannot make the gateway tokenize megabytes of ordinary text it throws away), and
the ids kept are always those of the whole text: a completion prompt, runs no cut can split
safely, a chat conversation, and a chat whose content holds control-token text."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.openai_chat_protocol import ChatCompletionRequest
from gateway.prompts import PromptEncoder

KEEP = 40


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _prose(chars: int, seed: int = 0) -> str:
    words = ["the", "list", "of", "tokens", "cache", "adapter", "prefix", "block", "engine",
             "42", "3.14", "(x)", "don't", "\n\n", "  ", "naïve", "日本"]
    rng = random.Random(seed)
    out: list[str] = []
    while sum(map(len, out)) < chars:
        out.append(rng.choice(words) + rng.choice([" ", "", ", ", ". "]))
    return "".join(out)


def test_a_truncated_prompt_keeps_the_whole_texts_last_ids(
        tokenizer: PreTrainedTokenizerBase) -> None:
    encoder = PromptEncoder(tokenizer)
    text = _prose(encoder.tail_chars(KEEP) * 5)
    for special in (True, False):
        whole = tokenizer(text, add_special_tokens=special)["input_ids"]
        kept = asyncio.run(encoder.encode_prompt(text, special, keep_tokens=KEEP))
        assert kept == whole[-KEEP:]
    short = "a short prompt"  # shorter than what is kept: every id, the BOS included
    assert asyncio.run(encoder.encode_prompt(short, keep_tokens=KEEP)) == \
        tokenizer(short)["input_ids"][-KEEP:]


@pytest.mark.parametrize("text", ["a" * 40_001, "=" * 40_001, "\n" * 40_001,
                                  "ab" * 20_000 + "a", "x " * 20_000],
                         ids=["letters", "symbols", "newlines", "pairs", "words"])
def test_runs_longer_than_the_margin_keep_the_whole_texts_ids(
        tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    """A run that is one piece of the pre-tokenizer merges differently from wherever it is
    cut: such a text is tokenized whole, and the ids kept are still the whole text's."""
    encoder = PromptEncoder(tokenizer)
    whole = tokenizer(text)["input_ids"]
    assert asyncio.run(encoder.encode_prompt(text, keep_tokens=KEEP)) == whole[-KEEP:]


def test_only_the_tail_of_ordinary_text_is_tokenized(tokenizer: PreTrainedTokenizerBase,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = PromptEncoder(tokenizer)
    lengths: list[int] = []
    call = tokenizer.__class__.__call__

    def counting(self: PreTrainedTokenizerBase, text: str, **kwargs: object) -> object:
        lengths.append(len(text))
        return call(self, text, **kwargs)

    monkeypatch.setattr(tokenizer.__class__, "__call__", counting)
    text = _prose(encoder.tail_chars(KEEP) * 20)
    asyncio.run(encoder.encode_prompt(text, keep_tokens=KEEP))
    assert lengths == [encoder.tail_chars(KEEP)]


def test_a_truncated_chat_keeps_the_whole_conversations_last_ids(
        tokenizer: PreTrainedTokenizerBase) -> None:
    encoder = PromptEncoder(tokenizer)
    control = tokenizer.eos_token
    assert control
    tail = encoder.tail_chars(KEEP)
    for content in (_prose(tail * 3, seed=1),
                    _prose(tail * 3, seed=2) + control + _prose(tail // 2, seed=3)):
        chat = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": content}]})
        whole = asyncio.run(encoder.encode_chat_request(chat, context=len(content)))
        assert asyncio.run(encoder.encode_chat_request(chat, len(content), KEEP)) == \
            whole[-KEEP:]
