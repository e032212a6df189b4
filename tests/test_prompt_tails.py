"""Truncated prompts are tokenized from their tail only (a client cannot make the gateway
tokenize megabytes it throws away), and the ids kept are those of the whole text: a
completion prompt, a chat conversation, and a chat whose content holds control-token text
(the marked path), wherever the cut falls."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.prompts import TAIL_MARGIN_TOKENS, PromptEncoder

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


def test_only_the_tail_is_tokenized(tokenizer: PreTrainedTokenizerBase,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = PromptEncoder(tokenizer)
    seen: list[int] = []
    encode = encoder._encode

    def counting(text: str, add_special_tokens: bool = False) -> list[int]:
        seen.append(len(text))
        return encode(text, add_special_tokens)

    monkeypatch.setattr(encoder, "_encode", counting)
    asyncio.run(encoder.encode_prompt("x " * 1_000_000, keep_tokens=KEEP))
    assert seen == [(KEEP + TAIL_MARGIN_TOKENS) * encoder.longest_token]


def test_a_truncated_chat_keeps_the_whole_conversations_last_ids(
        tokenizer: PreTrainedTokenizerBase) -> None:
    encoder = PromptEncoder(tokenizer)
    control = tokenizer.eos_token
    assert control
    tail = encoder.tail_chars(KEEP)
    for content in (_prose(tail * 3, seed=1),
                    _prose(tail * 3, seed=2) + control + _prose(tail // 2, seed=3)):
        messages = [{"role": "user", "content": content}]
        whole = asyncio.run(encoder.encode_chat(messages))
        assert asyncio.run(encoder.encode_chat(messages, keep_tokens=KEEP)) == whole[-KEEP:]


def test_a_cut_inside_a_marker_moves_past_it(tokenizer: PreTrainedTokenizerBase) -> None:
    """Control-token text in a message becomes a marker while the conversation renders; a
    tail that starts inside one must not leave marker text behind."""
    encoder = PromptEncoder(tokenizer)
    control = str(tokenizer.eos_token)
    messages = [{"role": "user", "content": "ab " * 20 + control + " cd" * 20}]
    options = {"add_generation_prompt": True}
    whole = str(tokenizer.decode(encoder._chat_ids(messages, options),
                                 skip_special_tokens=False))
    assert control in whole  # as plain text
    for tail in range(1, 200):
        text = str(tokenizer.decode(encoder._chat_ids(messages, options, tail=tail),
                                    skip_special_tokens=False))
        assert "\ue000" not in text
        assert whole.endswith(text), (tail, text)
