"""When a stop ends a request, as vLLM decides it: only a stop string that ends in new text
counts (none in the first min_tokens tokens' text, even once more tokens came), a stop
string completed by the last allowed token is a "stop", not a "length", and min_tokens
holds end-of-sequence back under ignore_eos too."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import LLMEngine
from engine.logits_processors import RowState, adjust_logits
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> int | None:
    """Tokens one at a time; the count at which a stop string matched (None: never)."""
    for count, token in enumerate(ids, 1):
        detok.add_tokens([token])
        if detok.stopped:
            return count
    return None


def test_a_stop_string_within_min_tokens_is_not_matched_later(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tokenizer("Paris. The answer is here. Done", add_special_tokens=False)["input_ids"]
    first_dot = next(n for n in range(1, len(ids) + 1)
                     if "." in tokenizer.decode(ids[:n]))
    # A long second stop string holds the text back far enough to still hold the first ".".
    stops = (".", "a much longer stop string")
    detok = IncrementalDetokenizer(tokenizer, stops, True, min_tokens=first_dot + 1)
    at = _feed(detok, ids)
    assert at is not None and at > first_dot + 1, (at, first_dot)
    assert detok.matched_stop == "." and detok.text == "Paris. The answer is here"
    plain = IncrementalDetokenizer(tokenizer, stops, True)
    assert _feed(plain, ids) == first_dot and plain.text == "Paris"


def _run(engine: LLMEngine, params: SamplingParams) -> RequestOutput:
    engine.add_request("r", [5, 6, 7], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("no output")


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(
        tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_model(str(tiny_model_dir), max_num_seqs=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    whole = _run(engine, greedy)
    assert whole.finish_reason == "length" and whole.stop_reason is None
    before_last = engine.tokenizer.decode(whole.token_ids[:-1], skip_special_tokens=True)
    assert len(whole.text) > len(before_last), "the last token must add text"
    # The whole text as the stop string: only the sixth token can complete it.
    cut = _run(engine, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                      stop=(whole.text,)))
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("", "stop", whole.text)
    assert len(cut.token_ids) == 6


def test_min_tokens_holds_end_of_sequence_back_under_ignore_eos() -> None:
    logits = torch.zeros(1, 16)
    params = SamplingParams(min_tokens=3, ignore_eos=True, max_tokens=8)
    got = adjust_logits(logits, [RowState(params, 1, [], 0)], frozenset({2}), None)
    assert got[0, 2] == float("-inf") and torch.isfinite(got[0, :2]).all()
