"""The sampler draws from the distribution its parameters define: temperature, top-k, top-p
(over what top-k kept), min-p, alone and together, on the fast path and on the whole-row
path a flat distribution takes; frequencies of many draws against the exact probabilities."""

from __future__ import annotations

import pytest
import torch

from engine import sampler as sampler_module
from engine.logits_processors import RowState
from engine.sampler import Sampler, generator_seed
from engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0])
DRAWS = 20_000


def _expected(params: SamplingParams) -> torch.Tensor:
    """The distribution by its definition, computed the slow, obvious way."""
    probs = (LOGITS / params.temperature).softmax(-1)
    if params.min_p:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    if params.top_k:
        keep[order[:params.top_k]] = True
    else:
        keep[:] = True
    kept = torch.where(keep, probs, 0.0)
    total = kept.sum()
    mass_before = 0.0
    for token in order.tolist():
        if kept[token] == 0:
            continue
        if mass_before >= params.top_p * total:
            kept[token] = 0.0
        mass_before += float(probs[token]) if keep[token] else 0.0
    return kept / kept.sum()


CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "min_p": SamplingParams(temperature=1.2, min_p=0.2),
    "top_k+top_p": SamplingParams(temperature=1.0, top_k=4, top_p=0.8),
    "all": SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("candidates", [1024, 2], ids=["candidates", "whole-row"])
@pytest.mark.parametrize("name", list(CASES))
def test_draws_follow_the_defined_distribution(name: str, candidates: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 candidates: every top-p row without top-k reaches past them and is sorted whole.
    monkeypatch.setattr(sampler_module, "TOP_CANDIDATES", candidates)
    params = CASES[name]
    expected = _expected(params)
    sampler = Sampler(seed=1, device=CPU)
    rows = [RowState(params, 0, [], 0)] * DRAWS
    tokens, _ = sampler.sample(LOGITS.expand(DRAWS, -1).clone(), ["r"] * DRAWS, rows)
    freq = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double() / DRAWS
    assert set(torch.tensor(tokens).unique().tolist()) <= set(
        expected.nonzero().flatten().tolist())  # a dropped token is never drawn
    spread = 5 * (expected * (1 - expected) / DRAWS).sqrt() + 1e-9
    assert bool(((freq - expected.double()).abs() <= spread).all()), (name, freq, expected)


def test_top_p_keeps_the_most_likely_token_even_when_it_alone_passes_top_p() -> None:
    sampler = Sampler(seed=0, device=CPU)
    params = SamplingParams(temperature=1.0, top_p=0.01)
    tokens, _ = sampler.sample(LOGITS.expand(200, -1).clone(), ["r"] * 200,
                               [RowState(params, 0, [], 0)] * 200)
    assert set(tokens) == {0}


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch() -> None:
    def draws(batch: int) -> list[int]:
        sampler = Sampler(seed=5, device=CPU)
        seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=123)
        sampler.prepare("mine", seeded)
        rows = [RowState(seeded, 0, [], 0)] + [RowState(SamplingParams(), 0, [], 1)] * batch
        ids = ["mine"] + [f"other{i}" for i in range(batch)]
        return [sampler.sample(LOGITS.expand(len(ids), -1).clone(), ids, rows)[0][0]
                for _ in range(50)]
    assert draws(0) == draws(7) == draws(31)


def test_greedy_takes_the_first_of_tied_maxima() -> None:
    logits = torch.full((3, 4096), -1.0)
    logits[0, [9, 4000]] = 5.0           # a tie: the lower id, as argmax picks
    logits[1, 4095] = 2.0                # the last column
    logits[2, [10, 3000]] = 3e38
    rows = [RowState(SamplingParams(temperature=0.0), 0, [], i) for i in range(3)]
    tokens, _ = Sampler(0, CPU).sample(logits, ["a", "b", "c"], rows)
    assert tokens == [9, 4095, 10] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "random"])
def test_a_row_that_allows_no_token_gets_none(temperature: float) -> None:
    # The adjustments (allowed ids, bans, a grammar) can leave a row without any token: the
    # sampler says so instead of picking one of the forbidden ones.
    logits = LOGITS.expand(2, -1).clone()
    rows = [RowState(SamplingParams(temperature=temperature, logprobs=2), 0, [], i)
            for i in range(2)]

    def ban_all_of_row_0(raw: torch.Tensor) -> torch.Tensor:
        adjusted = raw.clone()
        adjusted[0] = float("-inf")
        return adjusted

    tokens, logprobs = Sampler(0, CPU).sample(logits, ["a", "b"], rows, ban_all_of_row_0)
    assert tokens[0] == sampler_module.NO_TOKEN and logprobs[0] is None
    assert 0 <= tokens[1] < LOGITS.numel() and logprobs[1] is not None


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "random"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_row_of_non_finite_logits_gets_no_token(temperature: float, bad: float) -> None:
    # An adapter whose finite weights overflow in the forward: its rows are not numbers,
    # and nothing may be sampled from them (the others of the batch are unaffected).
    logits = LOGITS.expand(3, -1).clone()
    logits[1, 3:5] = bad
    rows = [RowState(SamplingParams(temperature=temperature, logprobs=2), 0, [], i)
            for i in range(3)]
    tokens, logprobs = Sampler(0, CPU).sample(logits, ["a", "b", "c"], rows)
    assert tokens[1] == sampler_module.NON_FINITE and logprobs[1] is None
    assert all(0 <= tokens[i] < LOGITS.numel() and logprobs[i] for i in (0, 2))


def test_seeds_that_share_their_low_32_bits_draw_apart_on_the_cpu() -> None:
    # torch's CPU generator keeps a seed's low 32 bits only: 1 and 2**32 + 1 drew alike.
    def draws(seed: int) -> list[float]:
        generator = torch.Generator().manual_seed(generator_seed(seed, CPU))
        return torch.rand(4, generator=generator).tolist()

    assert generator_seed(12345, CPU) == 12345  # below 2**32: as it was
    seeds = [0, 1, 2**32, 2**32 + 1, 2**63, -2, -3, 2**64 - 1]
    assert len({tuple(draws(seed)) for seed in seeds}) == len(seeds)
    assert draws(2**40 + 7) == draws(2**40 + 7)  # still a seed: the same draws each time
    assert draws(-2) == draws(2**64 - 2)  # a negative seed is its two's complement (torch's)
    assert all(0 <= generator_seed(seed, CPU) < 2**32 for seed in seeds)
