"""Helpers shared by parity tests: run a workload through LLMEngine, check it against
transformers with teacher forcing."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.llm_engine import LLMEngine
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams

# fp32: our flat-batch forward and transformers' padded forward differ only in summation
# order, so log-probs agree to ~1e-6; 1e-4 leaves room without hiding a real bug (a wrong
# position, mask or block gives differences of order 0.1 and more).
FP32_LOGPROB_ATOL = 1e-4
NEAR_TIE = 1e-4


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival_step: int


def random_workload(n: int, seed: int, max_prompt: int = 300, max_output: int = 24,
                    max_arrival_step: int = 40, vocab: int = 512) -> list[WorkItem]:
    rng = random.Random(seed)
    return [
        WorkItem(
            request_id=f"r{i}",
            prompt=[rng.randrange(5, vocab) for _ in range(rng.randint(1, max_prompt))],
            max_tokens=rng.randint(1, max_output),
            arrival_step=rng.randint(0, max_arrival_step),
        )
        for i in range(n)
    ]


def shared_prefix_workload(n: int, seed: int, num_docs: int = 4, vocab: int = 512
                           ) -> list[WorkItem]:
    """RAG-like: each prompt is one of a few shared documents plus a private question."""
    rng = random.Random(seed)
    docs = [[rng.randrange(5, vocab) for _ in range(rng.randint(30, 150))]
            for _ in range(num_docs)]
    return [
        WorkItem(
            request_id=f"s{i}",
            prompt=rng.choice(docs) + [rng.randrange(5, vocab)
                                       for _ in range(rng.randint(1, 40))],
            max_tokens=rng.randint(1, 20),
            arrival_step=rng.randint(0, 60),
        )
        for i in range(n)
    ]


def run_workload(engine: LLMEngine, items: list[WorkItem], logprobs: int = 5,
                 loras: dict[str, str | None] | None = None) -> dict[str, RequestOutput]:
    """Add each item at its arrival step (with its adapter in `loras`, by request id, if
    given); step until everything finished."""
    pending = sorted(items, key=lambda w: w.arrival_step)
    finished: dict[str, RequestOutput] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_step <= step:
            w = pending.pop(0)
            engine.add_request(w.request_id, w.prompt, SamplingParams(
                max_tokens=w.max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs),
                lora=(loras or {}).get(w.request_id))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
    return finished


def load_reference(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


@torch.inference_mode()
def check_against_reference(ref: torch.nn.Module, prompt: list[int], out: RequestOutput,
                            atol: float = FP32_LOGPROB_ATOL, check_greedy: bool = True) -> None:
    """Teacher-forced: every generated token is transformers' argmax (or a near-tie) at its
    position, and every reported log-prob matches transformers' log-softmax within atol."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    ids = torch.tensor([prompt + out.token_ids[:-1]])
    logits = ref(ids).logits[0, len(prompt) - 1:].float()
    ref_lp = logits.log_softmax(dim=-1)
    for pos, token in enumerate(out.token_ids):
        row = ref_lp[pos]
        if check_greedy:
            assert float(row[token]) >= float(row.max()) - NEAR_TIE, (
                f"{out.request_id} token {pos}: chose {token} ({float(row[token]):.6f}), "
                f"reference argmax {int(row.argmax())} ({float(row.max()):.6f})")
        for tid, lp in out.logprobs[pos].items():
            assert abs(lp - float(row[tid])) <= atol, (
                f"{out.request_id} token {pos} id {tid}: logprob {lp:.6f} vs "
                f"reference {float(row[tid]):.6f}")
