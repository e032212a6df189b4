"""Logprobs through the gateway with the official `openai` client, shaped as OpenAI's:
completions' tokens / token_logprobs / top_logprobs / text_offset (the chosen token always
among the top ones), chat's per-token entries with bytes, streamed as whole, and vLLM's
return_token_ids / return_tokens_as_token_ids. Against the package's live engine + gateway.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionTokenLogprob
from transformers import PreTrainedTokenizerBase

from tests.openai_api.helpers import MAX_TOKENS, MESSAGES, NO_EOS


def test_completion_logprobs_are_shaped_like_openai(client: openai.OpenAI,
                                                    base_model: str) -> None:
    request: dict[str, Any] = {"model": base_model, "prompt": "hello world",
                               "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2,
                               "extra_body": NO_EOS}
    whole = client.completions.create(**request)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None
    tokens, chosen = logprobs.tokens, logprobs.token_logprobs
    tops, offsets = logprobs.top_logprobs, logprobs.text_offset
    assert tokens is not None and chosen is not None and tops is not None
    assert offsets is not None
    assert len(tokens) == len(chosen) == len(tops) == len(offsets) == MAX_TOKENS
    # Offsets index the text (a token holding part of a character begins where the
    # character will, as in vLLM): a whole token's string stands at its offset.
    text = whole.choices[0].text
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    for i, (token, offset) in enumerate(zip(tokens, offsets, strict=True)):
        near = tokens[max(0, i - 3):i + 1]  # no part of a character (named "") near it, and
        if "\ufffd" not in "".join(near) and "" not in near:  # no invalid bytes (U+FFFD)
            assert text[offset:offset + len(token)] == token
    for token, logprob, top in zip(tokens, chosen, tops, strict=True):
        assert isinstance(token, str) and logprob is not None and logprob <= 0.0
        assert 1 <= len(top) <= 2  # two alternatives (fewer if both decode alike)
        assert max(top.values()) == logprob and top.get(token) == logprob  # greedy: top-1

    chunks = list(client.completions.create(**request, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens or []] == tokens
    streamed_tops = [t for lp in streamed for t in lp.top_logprobs or []]
    assert [list(t) for t in streamed_tops] == [list(t) for t in tops]
    # Values agree to float32 rounding (a request may hit blocks the previous one cached).
    assert [t for lp in streamed for t in lp.token_logprobs or []] == pytest.approx(chosen,
                                                                                    abs=1e-4)
    assert [v for t in streamed_tops for v in t.values()] == pytest.approx(
        [v for t in tops for v in t.values()], abs=1e-4)
    assert [t for lp in streamed for t in lp.text_offset or []] == offsets


def test_completion_top_logprobs_hold_the_sampled_token(client: openai.OpenAI,
                                                         base_model: str) -> None:
    """As OpenAI: "always the logprob of the sampled token, so up to logprobs+1 elements"
    (a client may look each token up in its own entry)."""
    done = client.completions.create(model=base_model, prompt="hello world", max_tokens=16,
                                     temperature=2.0, seed=3, logprobs=1, extra_body=NO_EOS)
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
    outside = 0
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
        assert token in top and 1 <= len(top) <= 2
        outside += len(top) == 2
    assert outside  # at temperature 2 some sampled tokens are not the most likely


def test_chat_logprobs_are_shaped_like_openai(client: openai.OpenAI, base_model: str) -> None:
    request: dict[str, Any] = {"model": base_model, "messages": MESSAGES,
                               "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
                               "top_logprobs": 2, "extra_body": NO_EOS}
    whole = client.chat.completions.create(**request)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == MAX_TOKENS
    for entry in logprobs.content:
        assert _spells(entry.bytes, entry.token)
        assert len(entry.top_logprobs) == 2
        first, second = entry.top_logprobs
        assert (first.token, first.logprob) == (entry.token, entry.logprob)  # greedy
        assert entry.logprob <= 0.0 and second.logprob <= first.logprob
        assert all(_spells(t.bytes, t.token) for t in entry.top_logprobs)

    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs is not None
                for e in c.choices[0].logprobs.content or []]
    assert _shape(streamed) == _shape(logprobs.content)
    # Values agree to float32 rounding: the second request may hit the prefix cache.
    assert _values(streamed) == pytest.approx(_values(logprobs.content), abs=1e-4)

    plain = client.chat.completions.create(**{**request, "top_logprobs": None})
    assert plain.choices[0].logprobs is not None
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content or [])


def _spells(token_bytes: list[int] | None, token: str) -> bool:
    """A token's bytes are its text's UTF-8; or it holds part of a character: named "" if
    the character is not complete yet, or by all of it, ending in its own bytes, where it
    completes it (or the bytes are no UTF-8 at all: U+FFFD, as the random model makes)."""
    assert token_bytes is not None
    raw = bytes(token_bytes)
    return raw == token.encode() or token == "" or token.encode().endswith(raw) or \
        "\ufffd" in token


def test_return_token_ids_and_tokens_as_ids(client: openai.OpenAI, base_model: str,
                                            tokenizer: PreTrainedTokenizerBase) -> None:
    extra = {**NO_EOS, "return_token_ids": True}
    request: dict[str, Any] = {"model": base_model, "prompt": "hello world",
                               "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": extra}
    choice = client.completions.create(**request).choices[0]
    fields = choice.model_extra or {}
    assert fields["prompt_token_ids"] == tokenizer("hello world")["input_ids"]
    generated = fields["token_ids"]
    assert len(generated) == MAX_TOKENS
    assert tokenizer.decode(generated, skip_special_tokens=True) == choice.text
    events = [c.choices[0].model_extra or {} for c in
              client.completions.create(**request, stream=True) if c.choices]
    assert events[0]["prompt_token_ids"] == fields["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])  # the first event only
    assert [t for e in events for t in e.get("token_ids", [])] == generated

    chat = client.chat.completions.create(
        model=base_model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, extra_body=extra)
    assert (chat.model_extra or {})["prompt_token_ids"]  # on the response, as vLLM puts it
    ids = (chat.choices[0].model_extra or {})["token_ids"]
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(ids) == len(content) == MAX_TOKENS
    # The tokens' bytes joined are the text's UTF-8 (special tokens are not in the text).
    special = set(tokenizer.all_special_ids)
    joined = b"".join(bytes(e.bytes or []) for e, i in zip(content, ids, strict=True)
                      if i not in special)
    assert joined.decode("utf-8", errors="replace") == chat.choices[0].message.content

    as_ids = client.completions.create(**{**request, "logprobs": 1, "extra_body": {
        **NO_EOS, "return_tokens_as_token_ids": True}}).choices[0]
    assert as_ids.logprobs is not None and as_ids.logprobs.tokens is not None
    assert as_ids.logprobs.tokens == [f"token_id:{i}" for i in generated]


def _shape(entries: list[ChatCompletionTokenLogprob]) -> list[tuple[Any, ...]]:
    return [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs])
            for e in entries]


def _values(entries: list[ChatCompletionTokenLogprob]) -> list[float]:
    return [v for e in entries for v in (e.logprob, *(t.logprob for t in e.top_logprobs))]


