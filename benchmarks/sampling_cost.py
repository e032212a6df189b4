"""The sampler's cost per step with the sampling controls on, against plain sampling.

    python -m benchmarks.sampling_cost [--rows 64] [--vocab 49152] [--repeats 50]
                                       [--threads 2]

One step's sampling of ``rows`` running requests over a vocabulary of ``vocab`` logits (the
default is SmolLM2's), as the runner does it (engine/sampler.py with the adjustments of
engine/logits_processors.py), over logits shaped like a language model's and over flat
ones, with every row asking for: nothing (greedy, then random sampling with temperature 0.8
and top_p 0.95), the three penalties, min_p, logit_bias (16 ids) + min_tokens +
allowed_token_ids (256 ids) + bad words, and everything at once. Each request has a
200-token output history. Prints the median ms per step and the ratio to plain random
sampling; the penalties' counts are kept incrementally, so the history length does not
enter a step's cost.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from engine.logits_processors import PenaltyCounts, RowState, adjust_logits
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = frozenset({0})


def _params(kind: str, rng: random.Random) -> SamplingParams:
    random_sampling: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95}
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=512)
    if kind == "random":
        return SamplingParams(max_tokens=512, **random_sampling)
    penalties: dict[str, Any] = {"presence_penalty": 0.5, "frequency_penalty": 0.5,
                                 "repetition_penalty": 1.2}
    lists: dict[str, Any] = {
             "logit_bias": tuple((rng.randrange(1000), 2.0) for _ in range(16)),
             "min_tokens": 400, "allowed_token_ids": tuple(range(256)),
             "bad_words_token_ids": ((5, 6), (7,), (8, 9, 10))}
    chosen: dict[str, Any] = {"penalties": penalties, "min_p": {"min_p": 0.05}, "lists": lists,
              "everything": {**penalties, **lists, "min_p": 0.05}}[kind]
    return SamplingParams(max_tokens=512, **random_sampling, **chosen)


def _logits(rows: int, vocab: int, flat: bool) -> torch.Tensor:
    """Standard normal logits (flat: top-p's nucleus spans most of the vocabulary), or a
    language model's shape: the r-th likeliest token with logit -1.5 ln r plus a little
    noise, in a random order per row (the top few hundred tokens hold >95% of the mass)."""
    gen = torch.Generator().manual_seed(0)
    if flat:
        return torch.randn(rows, vocab, generator=gen)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    shaped = -1.5 * ranks.log() + 0.1 * torch.randn(rows, vocab, generator=gen)
    order = torch.rand(rows, vocab, generator=gen).argsort(dim=-1)
    return shaped.gather(1, order)


def time_kind(kind: str, rows: int, vocab: int, repeats: int, flat: bool) -> float:
    rng = random.Random(0)
    counts = PenaltyCounts(rows, vocab, CPU)
    sampler = Sampler(0, CPU)
    states = []
    for row in range(rows):
        params = _params(kind, rng)
        output = [rng.randrange(vocab) for _ in range(200)]
        if params.penalized:
            counts.start(row, [rng.randrange(vocab) for _ in range(300)], output)
        states.append(RowState(params, len(output), output[-2:], row))
    ids = [f"r{row}" for row in range(rows)]
    logits = _logits(rows, vocab, flat)
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        tokens, _ = sampler.sample(logits, ids, states,
                                   lambda raw: adjust_logits(raw, states, EOS, counts))
        penalized = [s.counts_row for s in states if s.params.penalized]
        if penalized:
            counts.add(torch.tensor(penalized), torch.tensor(tokens[:len(penalized)]))
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for flat in (False, True):
        base = None
        shape = "flat logits" if flat else "LM-shaped logits"
        for kind in ("greedy", "random", "penalties", "min_p", "lists", "everything"):
            ms = time_kind(kind, args.rows, args.vocab, args.repeats, flat)
            if kind == "random":
                base = ms
            ratio = f"{ms / base:5.2f}x random" if base else ""
            print(f"{shape}, {kind:11s} {args.rows} rows x {args.vocab} vocab: "
                  f"{ms:7.2f} ms/step  {ratio}", flush=True)


if __name__ == "__main__":
    main()
