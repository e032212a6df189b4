"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.logits_processors import RowState
from engine.sampling_params import SamplingParams


class Sampler:
    """Picks one token per row of a logits batch.

    Random rows use the exponential-race trick: argmax(p / E) with E ~ Exp(1) draws from p.
    A request with a seed owns a generator that draws exactly V exponentials per token, so
    its samples do not depend on which other requests share the batch. Requests without a
    seed share the engine's generator.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def prepare(self, request_id: str, params: SamplingParams) -> None:
        """Make a request's own state (its seeded generator) when it is admitted, so that
        nothing per-request is created, or can fail, inside a step."""
        if params.seed is not None and not params.greedy:
            self._per_request[request_id] = torch.Generator(
                device=self.device).manual_seed(params.seed)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._per_request.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], rows: list[RowState],
        adjust: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: [N, V] float32, one row per request; adjust: the logit adjustments
        (engine/logits_processors.py), applied before choosing. Returns token ids and, per
        row, {token: logprob} for the chosen token plus the top-k alternatives of the raw
        logits (None if not asked)."""
        params = [r.params for r in rows]
        raw = logits
        if adjust is not None:
            logits = adjust(raw)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            tokens[index] = self._sample_random(
                logits[index], [request_ids[i] for i in random_rows],
                [params[i] for i in random_rows],
            )
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw, token_list, params)

    def _sample_random(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        x = logits / temps[:, None]
        vocab = x.shape[-1]
        order: torch.Tensor | None = None
        if any(p.top_k or p.top_p < 1.0 for p in params):
            x, order = x.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=x.device)
            top_k = torch.tensor([p.top_k or vocab for p in params], device=x.device)
            x = x.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
            top_p = torch.tensor([p.top_p for p in params], device=x.device)
            probs_sorted = x.softmax(dim=-1)
            # Drop a token when the mass strictly before it already reaches top_p; the most
            # likely token always stays.
            mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            x = x.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        probs = x.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=x.device)
            floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs)
        for i, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            noise[i].exponential_(generator=self._generator(request_id, p))
        choice = (probs / noise).argmax(dim=-1)
        if order is not None:
            choice = order.gather(1, choice[:, None]).squeeze(1)
        return choice

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        return self._per_request[request_id]  # made by prepare() at admission

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]
    ) -> list[dict[int, float] | None]:
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(params)
        if not wanted:
            return result
        logprobs = logits[wanted].log_softmax(dim=-1)
        k = max(params[i].logprobs or 0 for i in wanted)
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        for j, i in enumerate(wanted):
            entry = {tokens[i]: float(logprobs[j, tokens[i]])}
            n_top = params[i].logprobs or 0
            if n_top and top_vals is not None and top_ids is not None:
                for tid, val in zip(top_ids[j, :n_top].tolist(), top_vals[j, :n_top].tolist(),
                                    strict=True):
                    entry.setdefault(tid, val)
            result[i] = entry
        return result
