"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.logits_processors import RowState
from engine.sampling_params import SamplingParams

NO_TOKEN = -1
"""The token of a row whose adjusted logits allow none (every token -inf: allowed_token_ids,
bad_words, min_tokens and a grammar can together exclude all): the request
cannot go on, and the engine ends it with an error instead of emitting a forbidden token."""
NON_FINITE = -2
"""The token of a row whose logits are NaN or +inf (an adapter whose finite weights overflow
in the forward, a model that does): there is nothing to sample, and the engine ends the
request with an error instead of emitting an arbitrary token with a made-up logprob."""
TOP_CANDIDATES = 1024
"""Top-k / top-p rows first look at this many most likely tokens (torch.topk, ~8x cheaper
than sorting a 49k vocabulary); a top-p row whose nucleus reaches past them (a very flat
distribution) is sorted whole, so the result is exact either way."""


_MASK64 = (1 << 64) - 1


def generator_seed(seed: int, device: torch.device) -> int:
    """The seed a request's generator takes. torch's CPU generator keeps only a seed's low 32
    bits, so 1 and 2**32 + 1 (and 0, 2**63 and -2**63) drew the same numbers: on the CPU a
    seed of 32 bits or more is mixed down to 32 (SplitMix64's finalizer: distinct seeds
    collide by chance only, ~2**-32), one below 2**32 is taken as it is. Other devices keep
    all 64 bits."""
    if device.type != "cpu" or 0 <= seed < 1 << 32:
        return seed
    mixed = seed & _MASK64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (mixed ^ (mixed >> 31)) >> 32


class Sampler:
    """Picks one token per row of a logits batch.

    Random rows draw by inverse CDF: one uniform per row against the cumulative
    probabilities (float64), so a request with a seed owns a generator that draws exactly
    one number per token, whichever other requests share the batch. (Its logits may still
    differ in the last bits between batch shapes, so a draw that lands at a boundary
    between two tokens can rarely flip, as in vLLM outside its batch-invariant mode.)
    Requests without a seed share the engine's generator. (Drawing a noise value per
    vocabulary entry, the exponential race, cost ~48 ms per step for 64 rows of a 49k
    vocabulary; sorting the vocabulary for top-p another ~100 ms.)
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
                device=self.device).manual_seed(generator_seed(params.seed, self.device))

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._per_request.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], rows: list[RowState],
        adjust: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: [N, V] float32, one row per request; adjust: the logit adjustments
        (engine/logits_processors.py), applied before choosing. Returns token ids (NO_TOKEN
        for a row that allows none, NON_FINITE for a row of NaN or +inf logits) and, per
        row, {token: logprob} for the chosen token plus the top-k alternatives of the raw
        logits (None if not asked or no token)."""
        params = [r.params for r in rows]
        raw = logits
        if adjust is not None:
            logits = adjust(raw)
        # max's indices are argmax's (the first of tied maxima, NaN wins), in a third of the
        # time on a CPU: torch's CPU argmax over [32, 49152] float32 took 1.2 ms a step.
        best = logits.max(dim=-1)
        tokens = best.indices
        blocked = best.values == float("-inf")
        # A NaN anywhere in a row makes its max NaN; +inf is its max: one check per row.
        broken = best.values.isnan() | (best.values == float("inf"))
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            tokens[index] = self._sample_random(
                logits[index], [request_ids[i] for i in random_rows],
                [params[i] for i in random_rows],
            )
        # One read back for the tokens and the rows without one (a sync on a GPU).
        token_list = torch.where(broken, NON_FINITE,
                                 torch.where(blocked, NO_TOKEN, tokens)).tolist()
        return token_list, self._logprobs(raw, token_list, params)

    def _sample_random(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)
        probs = (logits / temps[:, None]).softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            # Relative to the top token, so the same before or after top-k / top-p.
            min_p = torch.tensor([p.min_p for p in params], device=device)
            floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        uniforms = self._uniforms(request_ids, params, device)
        choice = torch.empty(len(params), dtype=torch.int64, device=device)
        vocab = logits.shape[-1]
        # A top_k of the whole vocabulary or more keeps every token: the same draw as none.
        cut = [0 < p.top_k < vocab or p.top_p < 1.0 for p in params]
        truncated = [i for i, row_cut in enumerate(cut) if row_cut]
        whole = [i for i, row_cut in enumerate(cut) if not row_cut]
        if whole:
            rows = torch.tensor(whole, device=device)
            choice[rows] = _inverse_cdf(probs[rows], uniforms[rows])
        if truncated:
            rows = torch.tensor(truncated, device=device)
            choice[rows] = _sample_truncated(probs[rows], [params[i] for i in truncated],
                                             uniforms[rows])
        return choice

    def _uniforms(self, request_ids: list[str], params: list[SamplingParams],
                  device: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per row: seeded rows from their own generators, the others
        from the shared one in a single call."""
        uniforms = torch.empty(len(params), dtype=torch.float64, device=device)
        shared = [i for i, p in enumerate(params) if p.seed is None]
        if shared:
            uniforms[torch.tensor(shared, device=device)] = torch.rand(
                len(shared), dtype=torch.float64, device=device, generator=self._shared)
        for i, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.seed is not None:
                uniforms[i] = torch.rand(1, dtype=torch.float64, device=device,
                                         generator=self._per_request[request_id])[0]
        return uniforms

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]
    ) -> list[dict[int, float] | None]:
        wanted = [i for i, p in enumerate(params)
                  if p.logprobs is not None and tokens[i] >= 0]
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


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of (unnormalized, non-negative) probs [N, K] by its
    uniform in [0, 1). A zero-probability entry is never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return index.clamp_(max=probs.shape[1] - 1)


def _sample_truncated(probs: torch.Tensor, params: list[SamplingParams],
                      uniforms: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p over what top-k kept (renormalized), then a draw: probs [N, V]
    (softmaxed, min-p applied, as vLLM orders them). A token is dropped when the mass
    strictly before it already reaches top_p, so the most likely token always stays."""
    vocab = probs.shape[1]
    device = probs.device
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    width = min(vocab, max(TOP_CANDIDATES, max(p.top_k for p in params)))
    values, ids = probs.topk(width, dim=-1)  # most likely first
    ranks = torch.arange(width, device=device)
    values = values.masked_fill(ranks[None, :] >= top_k[:, None], 0.0).double()
    # What top-k kept: the candidates when it cut the row, else the whole row.
    kept = torch.where(top_k < vocab, values.sum(dim=-1), probs.double().sum(dim=-1))
    threshold = top_p * kept
    cumulative = values.cumsum(dim=-1)
    values = values.masked_fill(cumulative - values >= threshold[:, None], 0.0)
    choice = ids.gather(1, _inverse_cdf(values, uniforms)[:, None]).squeeze(1)
    # Rows whose nucleus reaches past the candidates (top-k off, a very flat row): sorted
    # whole, all such rows at once.
    flat = ((top_k >= vocab) & (cumulative[:, -1] < threshold)).nonzero().flatten()
    if flat.numel():
        flat_values, flat_ids = probs[flat].double().sort(dim=-1, descending=True)
        flat_values = flat_values.masked_fill(
            flat_values.cumsum(dim=-1) - flat_values >= threshold[flat][:, None], 0.0)
        choice[flat] = flat_ids.gather(
            1, _inverse_cdf(flat_values, uniforms[flat])[:, None]).squeeze(1)
    return choice
