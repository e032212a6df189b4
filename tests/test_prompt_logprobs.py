"""Prompt logprobs (vLLM's ``prompt_logprobs``; lm-eval's loglikelihood through ``echo``)
against transformers and PEFT: every prompt position's logprob, rank and top-k, across
chunked prefill, beside requests that do not ask, with a warm prefix cache (which such a
request must not read) and with an adapter."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from engine.input_batch import RunningRequest
from engine.llm import LLM
from engine.prompt_logprobs import PromptLogprob, plan_prompt_rows
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledChunk
from tests.parity import FP32_LOGPROB_ATOL, NEAR_TIE, load_reference


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def _check(ref: torch.nn.Module, prompt: list[int], out: RequestOutput, k: int) -> None:
    scored = out.prompt_logprobs
    assert scored is not None and len(scored) == len(prompt)
    assert scored[0] is None
    ref_lp = ref(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    for pos in range(1, len(prompt)):
        entry = scored[pos]
        assert isinstance(entry, PromptLogprob), pos
        row = ref_lp[pos - 1]
        want = float(row[prompt[pos]])
        assert entry.token_id == prompt[pos]
        assert abs(entry.logprob - want) <= FP32_LOGPROB_ATOL, (pos, entry.logprob, want)
        # Rank: 1 + tokens more likely than this one (near-ties may order either way).
        above = int((row > want + NEAR_TIE).sum())
        at_most = int((row > want - NEAR_TIE).sum())
        assert above + 1 <= entry.rank <= max(at_most, 1), (pos, entry.rank, above, at_most)
        assert len(entry.top) == k
        for rank, (token, lp) in enumerate(entry.top):
            assert abs(lp - float(row[token])) <= FP32_LOGPROB_ATOL
            assert float(row[token]) >= float(row.topk(k).values[rank]) - NEAR_TIE


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


def test_prompt_logprobs_match_transformers_across_chunks(tiny_model_dir: Path,
                                                          reference: torch.nn.Module) -> None:
    # A 48-token budget splits every long prompt into chunks, several requests per step.
    llm = LLM(str(tiny_model_dir), device="cpu", max_num_batched_tokens=48, max_num_seqs=4,
              block_size=16)
    prompts = _prompts(0, [130, 1, 2, 47, 49, 200])
    ks = [3, 0, 5, None, 1, 20]
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                             prompt_logprobs=k) for k in ks]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, k in zip(prompts, outs, ks, strict=True):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            _check(reference, prompt, out, k)
    # Asking for prompt logprobs changes nothing about the generated tokens.
    plain = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0,
                                                 ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_model_dir: Path,
                                                            reference: torch.nn.Module) -> None:
    llm = LLM(str(tiny_model_dir), device="cpu", prefix_caching="on", block_size=16)
    prompt = _prompts(1, [100])[0]
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], greedy, use_tqdm=False)
    engine = llm.engine
    before = engine.stats().prompt_tokens_computed
    llm.generate([prompt], greedy, use_tqdm=False)
    cached_run = engine.stats().prompt_tokens_computed - before
    assert cached_run < len(prompt)  # the cache serves a plain request...
    before = engine.stats().prompt_tokens_computed
    [out] = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0,
                                                  ignore_eos=True, prompt_logprobs=2),
                         use_tqdm=False)
    # ...but a request for prompt logprobs computes every prompt token (the first output
    # token's row included).
    assert engine.stats().prompt_tokens_computed - before >= len(prompt)
    _check(reference, prompt, out, 2)


def test_prompt_logprobs_with_an_adapter_match_peft(tiny_model_dir: Path,
                                                    tiny_adapters: dict[str, Path]) -> None:
    llm = LLM(str(tiny_model_dir), device="cpu", max_loras=2, max_num_batched_tokens=40)
    llm.load_lora("a1", str(tiny_adapters["a1"]))
    prompts = _prompts(2, [90, 60])
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False, lora=["a1", None])
    with torch.inference_mode():
        peft = PeftModel.from_pretrained(load_reference(tiny_model_dir),
                                         str(tiny_adapters["a1"])).eval()
    _check(peft, prompts[0], outs[0], 1)
    _check(load_reference(tiny_model_dir), prompts[1], outs[1], 1)


def test_a_recomputed_prompt_is_not_scored_again() -> None:
    params = SamplingParams(prompt_logprobs=0)
    fresh = RunningRequest([1, 2, 3, 4, 5], 0, 1, params, -1, 5)
    resumed = RunningRequest([1, 2, 3, 4, 5, 6], 1, 1, params, -1, 5)
    plain = RunningRequest([1, 2, 3], 2, 1, SamplingParams(), -1, 3)
    chunks = [ScheduledChunk("plain", 0, 3, [], True),
              ScheduledChunk("fresh", 2, 3, [], True),
              ScheduledChunk("resumed", 0, 6, [], True)]
    plan = plan_prompt_rows(chunks, {"fresh": fresh, "resumed": resumed, "plain": plain})
    # fresh: rows 3..4 hold positions 2..3, which predict prompt positions 3..4; its last
    # row (position 4) predicts the first output token and is not a prompt logprob.
    assert [(p.request_id, p.first_row, p.first_position, p.count) for p in plan] == [
        ("fresh", 3, 3, 2)]


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
