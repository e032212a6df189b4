"""Sampling controls against transformers' logits processors (repetition penalty, min-p,
min new tokens, bad words), the penalties by their formulas, and end to end through the
engine: greedy decoding with a repetition penalty equals transformers' generate."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from engine.llm_engine import LLMEngine
from engine.logits_processors import PenaltyCounts, RowState, adjust_logits
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from tests.parity import load_reference

CPU = torch.device("cpu")
VOCAB = 64
EOS = frozenset({1})


def _state(params: SamplingParams, prompt: list[int], output: list[int],
           counts: PenaltyCounts, row: int) -> RowState:
    if params.penalized:
        counts.start(row, prompt, output)
    longest = max((len(w) for w in params.bad_words_token_ids), default=1)
    return RowState(params, len(output), output[len(output) - longest + 1:] if longest > 1
                    else [], row)


def _history(rng: random.Random) -> tuple[list[int], list[int]]:
    return ([rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))],
            [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))])


@pytest.mark.parametrize("seed", range(5))
def test_repetition_penalty_matches_transformers(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    counts = PenaltyCounts(8, VOCAB, CPU)
    logits = torch.randn(4, VOCAB) * 3
    rows, expected = [], []
    for i in range(4):
        prompt, output = _history(rng)
        penalty = [1.0, 1.3, 0.7, 1.9][i]
        rows.append(_state(SamplingParams(repetition_penalty=penalty), prompt, output, counts,
                           7 - i))
        reference = RepetitionPenaltyLogitsProcessor(penalty)
        expected.append(reference(torch.tensor([prompt + output]), logits[i:i + 1].clone()))
    got = adjust_logits(logits, rows, EOS, counts)
    torch.testing.assert_close(got, torch.cat(expected))


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    counts = PenaltyCounts(4, VOCAB, CPU)
    prompt, output = [5, 5, 9], [3, 3, 3, 7, 9]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.5)
    logits = torch.randn(1, VOCAB)
    got = adjust_logits(logits, [_state(params, prompt, output, counts, 2)], EOS, counts)
    want = logits.clone()
    for token, times in ((3, 3), (7, 1), (9, 1)):  # 5 is only in the prompt: untouched
        want[0, token] -= 0.5 * times + 1.5
    torch.testing.assert_close(got, want)
    # Counts grow with each sampled token, without replaying the history.
    counts.add(torch.tensor([2]), torch.tensor([7]))
    again = adjust_logits(logits, [RowState(params, 6, [], 2)], EOS, counts)
    want[0, 7] -= 0.5
    torch.testing.assert_close(again, want)


def test_min_tokens_bans_end_of_sequence_and_stop_ids_as_transformers_does() -> None:
    logits = torch.randn(2, VOCAB)
    params = SamplingParams(min_tokens=4, stop_token_ids=(6,), max_tokens=10)
    before = RowState(params, 3, [], 0)
    after = RowState(params, 4, [], 1)
    got = adjust_logits(logits, [before, after], EOS, None)
    reference = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=4,
                                                  eos_token_id=[1, 6])
    want = reference(torch.zeros(1, 2 + 3, dtype=torch.int64), logits[:1].clone())
    torch.testing.assert_close(got[:1], want)
    torch.testing.assert_close(got[1:], logits[1:])  # four tokens out: nothing banned


def test_bad_words_match_transformers_on_the_output() -> None:
    words = ((4,), (8, 9), (10, 11, 12))
    params = SamplingParams(bad_words_token_ids=words)
    reference = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=1)
    logits = torch.randn(3, VOCAB)
    outputs = [[3, 8], [10, 11], [2, 2]]
    rows = [RowState(params, len(o), o[-2:], i) for i, o in enumerate(outputs)]
    got = adjust_logits(logits, rows, EOS, None)
    for i, output in enumerate(outputs):
        want = reference(torch.tensor([output]), logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want)


def test_logit_bias_and_allowed_token_ids() -> None:
    logits = torch.randn(3, VOCAB)
    rows = [RowState(SamplingParams(logit_bias=((5, 10.0), (6, -100.0))), 0, [], 0),
            RowState(SamplingParams(allowed_token_ids=(2, 3, 500)), 0, [], 1),
            RowState(SamplingParams(), 0, [], 2)]
    got = adjust_logits(logits, rows, EOS, None)
    assert got[0, 5] == logits[0, 5] + 10 and got[0, 6] == logits[0, 6] - 100
    assert torch.equal(got[0, :5], logits[0, :5])
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [2, 3]  # 500: no such id
    assert torch.equal(got[2], logits[2])
    first = logits[:1]  # no row asks for anything: the same tensor back, no copy
    assert adjust_logits(first, [RowState(SamplingParams(), 0, [], 0)], EOS, None) is first


def test_min_p_keeps_the_tokens_transformers_keeps() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 0.7  # flat enough that several tokens pass 0.2
    no_ids = cast(torch.LongTensor, torch.zeros(1, 1, dtype=torch.int64))
    kept = (MinPLogitsWarper(0.2)(no_ids, logits.clone())
            > float("-inf"))[0]
    sampler = Sampler(0, CPU)
    rows = [RowState(SamplingParams(min_p=0.2, temperature=1.0), 0, [], 0)]
    drawn = {sampler.sample(logits, ["r"], rows)[0][0] for _ in range(400)}
    assert 3 < len(drawn) <= int(kept.sum()) < VOCAB // 2
    assert drawn <= set(kept.nonzero().flatten().tolist())


def test_greedy_repetition_penalty_equals_transformers_generate(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_model(str(tiny_model_dir), max_num_seqs=4)
    prompts = [[5, 9, 17, 33, 9, 5], [100, 101, 102], [7] * 10]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            repetition_penalty=1.8, logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    ref = cast(Any, load_reference(tiny_model_dir))  # a transformers model: has generate
    for i, prompt in enumerate(prompts):
        generated = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                 repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
        assert done[f"r{i}"] == generated[0, len(prompt):].tolist()


def test_engine_honours_bias_restrictions_min_tokens_and_stop_strings(
        tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_model(str(tiny_model_dir), max_num_seqs=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("plain", [5, 6, 7], greedy)
    engine.add_request("bias", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias=((42, 100.0),)))
    engine.add_request("allowed", [5, 6, 7], SamplingParams(
        temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=(11, 12)))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["bias"].token_ids == [42] * 6
    assert set(done["allowed"].token_ids) <= {11, 12}
    first = done["plain"].token_ids[0]
    # Its first greedy token as a stop id: min_tokens holds it back for 3 tokens.
    engine.add_request("min", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=(first,), min_tokens=3))
    engine.add_request("stop", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=(first,)))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["stop"].token_ids == [first]
    assert len(done["min"].token_ids) >= 3 and first not in done["min"].token_ids[:3]
    text = done["plain"].text
    assert len(text) >= 4
    stop = text[2:4]
    for include in (False, True):
        name = f"include-{include}"
        engine.add_request(name, [5, 6, 7], SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, stop=(stop,),
            include_stop_str_in_output=include))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[name] = out
    cut = text[:text.find(stop)]
    assert done["include-False"].text == cut
    assert done["include-True"].text == cut + stop
