"""Batched logit adjustments before sampling: allowed tokens, bad words, min_tokens, logit
bias and the repetition / frequency / presence penalties (semantics: SamplingParams).

Rows that ask for nothing are not touched, and a step where no row asks costs one check of
a flag per row. The penalties read per-request token counts kept up to date incrementally
(PenaltyCounts: one row per running request, updated with the step's sampled tokens in one
scatter), so no step walks a request's whole history. The other adjustments gather their
(row, token) pairs from the rows that ask for them (each list bounded by MAX_TOKEN_LISTS)
into one index_put per kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


class PenaltyCounts:
    """For each row (a running request's row in the runner's InputBatch): how often each
    token was generated, and which tokens its prompt holds. Allocated at the first request
    that uses a penalty ([max_rows, vocab] int32 and bool)."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, device
        self._output: torch.Tensor | None = None
        self._prompt: torch.Tensor | None = None

    def start(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A request (re)starts running in ``row`` with these tokens so far."""
        if self._output is None or self._prompt is None:
            self._output = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.int32,
                                       device=self.device)
            self._prompt = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.bool,
                                       device=self.device)
        self._output[row] = 0
        self._prompt[row] = False
        if output_ids:
            ids = torch.tensor(output_ids, dtype=torch.int64, device=self.device)
            self._output[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        if prompt_ids:
            self._prompt[row, torch.tensor(prompt_ids, dtype=torch.int64,
                                           device=self.device)] = True

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one sampled token per row (rows distinct, all started)."""
        assert self._output is not None
        self._output.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                accumulate=True)

    def rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts [N, V] int32, prompt presence [N, V] bool) of these rows."""
        assert self._output is not None and self._prompt is not None
        return self._output.index_select(0, rows), self._prompt.index_select(0, rows)


@dataclass(frozen=True)
class RowState:
    """What the adjustments of one row need besides its parameters."""

    params: SamplingParams
    num_output_tokens: int
    output_tail: list[int]
    """The last output tokens (as many as the longest bad word needs)."""
    counts_row: int
    """Its PenaltyCounts row."""


def adjust_logits(logits: torch.Tensor, rows: list[RowState], stop_ids: frozenset[int],
                  counts: PenaltyCounts | None) -> torch.Tensor:
    """logits [N, V] float32, one row per RowState; returns the adjusted logits (a new
    tensor when any row asks for an adjustment, else ``logits`` itself). stop_ids: the
    model's end-of-sequence ids, banned with each row's stop_token_ids under min_tokens."""
    wanted = [i for i, r in enumerate(rows) if r.params.adjusts_logits]
    if not wanted:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for i in wanted:
        r = rows[i]
        p = r.params
        if p.allowed_token_ids:
            keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab],
                                dtype=torch.int64, device=logits.device)
            allowed = torch.full((vocab,), float("-inf"), device=logits.device)
            allowed[keep] = 0.0
            logits[i] += allowed
        for word in p.bad_words_token_ids:
            prefix = list(word[:-1])
            if len(prefix) <= len(r.output_tail) and (
                    not prefix or r.output_tail[len(r.output_tail) - len(prefix):] == prefix):
                banned_rows.append(i)
                banned_ids.append(word[-1])
        if r.num_output_tokens < p.min_tokens:
            # End-of-sequence ids too under ignore_eos (as vLLM and transformers ban them).
            for token in stop_ids | set(p.stop_token_ids):
                banned_rows.append(i)
                banned_ids.append(token)
        for token, value in p.logit_bias:
            bias_rows.append(i)
            bias_ids.append(token)
            bias_values.append(value)
    _put(logits, banned_rows, banned_ids, None, vocab)
    _put(logits, bias_rows, bias_ids, bias_values, vocab)
    penalized = [i for i in wanted if rows[i].params.penalized]
    if penalized:
        assert counts is not None
        _penalize(logits, penalized, [rows[i] for i in penalized], counts)
    return logits


def _put(logits: torch.Tensor, rows: list[int], ids: list[int], values: list[float] | None,
         vocab: int) -> None:
    """Ban (values None: -inf) or add values at (row, id) pairs; ids past the vocabulary,
    which no token can have, are skipped."""
    pairs = [(r, t, v) for r, t, v in zip(rows, ids, values or [0.0] * len(ids), strict=True)
             if t < vocab]
    if not pairs:
        return
    device = logits.device
    row_t = torch.tensor([r for r, _, _ in pairs], dtype=torch.int64, device=device)
    id_t = torch.tensor([t for _, t, _ in pairs], dtype=torch.int64, device=device)
    if values is None:
        logits[row_t, id_t] = float("-inf")
    else:
        logits.index_put_((row_t, id_t), torch.tensor([v for _, _, v in pairs],
                                                      dtype=logits.dtype, device=device),
                          accumulate=True)


def _penalize(logits: torch.Tensor, penalized: list[int], rows: list[RowState],
              counts: PenaltyCounts) -> None:
    device = logits.device
    index = torch.tensor(penalized, dtype=torch.int64, device=device)
    output, prompt = counts.rows(torch.tensor([r.counts_row for r in rows], dtype=torch.int64,
                                              device=device))
    x = logits.index_select(0, index)
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
    seen = prompt | (output > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
    x = x - freq * output.to(x.dtype) - presence * (output > 0).to(x.dtype)
    logits.index_copy_(0, index, x)
