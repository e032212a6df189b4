"""Prompt logprobs: how likely the model finds each prompt token given the tokens before it
(what lm-evaluation-harness's loglikelihood tasks and vLLM's ``prompt_logprobs`` read).

A prefill chunk's hidden row at position p predicts the token at p + 1, so a chunk of a
request that asks for them yields the logprobs of prompt positions [start + 1, end + 1),
capped at the prompt's last token. Those rows go through the LM head besides the one row
that samples; a request's prompt tokens are computed once (it reads nothing from the prefix
cache until its first token is sampled), and a prompt recomputed after a preemption is not
scored again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

# Gateways import PromptLogprob (without torch), and the request module imports it from here.
if TYPE_CHECKING:
    import torch

    from engine.input_batch import RunningRequest
    from engine.scheduler_output import ScheduledChunk

ROWS_PER_PASS = 256
"""Rows through the LM head at a time: bounds the [rows, vocab] logits held at once."""


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """One prompt token's log-probability given every token before it."""

    token_id: int
    logprob: float
    rank: int
    """1 for the most likely token at this position."""
    top: tuple[tuple[int, float], ...]
    """The request's k most likely (token id, logprob) here, best first (empty for k = 0)."""


@dataclass(frozen=True, slots=True)
class PromptRows:
    """The rows of one step's hidden states that score one request's prompt tokens."""

    request_id: str
    first_row: int
    first_position: int
    """Prompt position of the token the first row predicts (>= 1)."""
    count: int
    top_k: int


def plan_prompt_rows(chunks: list[ScheduledChunk],
                     requests: Mapping[str, RunningRequest]) -> list[PromptRows]:
    """Which rows score prompt tokens this step; ``chunks`` in batch order (the order their
    tokens were laid out in the flat batch)."""
    plan = []
    row = 0
    for chunk in chunks:
        request = requests[chunk.request_id]
        k = request.sampling_params.prompt_logprobs
        prompt = request.num_prompt_tokens
        # A request with output tokens already scored its prompt (this is a recompute).
        if k is not None and len(request.token_ids) == prompt:
            count = min(chunk.start_pos + chunk.num_tokens, prompt - 1) - chunk.start_pos
            if count > 0:
                plan.append(PromptRows(chunk.request_id, row, chunk.start_pos + 1, count, k))
        row += chunk.num_tokens
    return plan


def score_prompt_rows(hidden: torch.Tensor, plan: list[PromptRows],
                      requests: Mapping[str, RunningRequest],
                      compute_logits: Callable[[torch.Tensor], torch.Tensor]
                      ) -> dict[str, tuple[int, list[PromptLogprob]]]:
    """Per request: (first prompt position scored, a PromptLogprob per position from it).

    ``hidden`` is the step's [T, H] final hidden states; ``compute_logits`` the LM head
    (float32 logits). Log-softmax of the raw logits, as the sampler's logprobs."""
    import torch  # engine side only (see the imports above)

    rows = torch.cat([torch.arange(p.first_row, p.first_row + p.count) for p in plan])
    targets = torch.tensor([t for p in plan for t in requests[p.request_id].token_ids[
        p.first_position:p.first_position + p.count]], dtype=torch.int64)
    top_k = max(p.top_k for p in plan)
    target_lp: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_lp: list[list[float]] = []
    for begin in range(0, len(rows), ROWS_PER_PASS):
        part = rows[begin:begin + ROWS_PER_PASS].to(hidden.device)
        logprobs = torch.log_softmax(compute_logits(hidden[part]), dim=-1)
        wanted = targets[begin:begin + ROWS_PER_PASS].to(hidden.device)
        chosen = logprobs.gather(1, wanted[:, None])
        target_lp += chosen[:, 0].tolist()
        ranks += ((logprobs > chosen).sum(dim=1) + 1).tolist()
        if top_k:
            values, ids = logprobs.topk(top_k, dim=1)
            top_lp += values.tolist()
            top_ids += ids.tolist()
    out: dict[str, tuple[int, list[PromptLogprob]]] = {}
    i = 0
    for p in plan:
        entries = []
        for _ in range(p.count):
            top = tuple(zip(top_ids[i][:p.top_k], top_lp[i][:p.top_k], strict=True)
                        ) if p.top_k else ()
            entries.append(PromptLogprob(int(targets[i]), target_lp[i], ranks[i], top))
            i += 1
        out[p.request_id] = (p.first_position, entries)
    return out
