"""What a served request is charged (TPM, usage): each prompt an engine took, once per
prompt however many sequences it had, whether or not a token came back; and the tokens
generated, streamed or held for a whole response."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from engine.protocol import GenerateRequest
from gateway.job import Claim, Job
from gateway.openai_api import _used_tokens
from gateway.openai_format import PromptEcho, ResponseFormatter


def _jobs(prompts: list[list[int]], k: int, dispatched: bool) -> list[Job]:
    claim = Claim(None, 1.0)
    jobs = [Job(GenerateRequest(f"r{i}-{j}", ids), "completions", claim)
            for i, ids in enumerate(prompts) for j in range(k)]
    for job in jobs:
        job.instance_id = "engine-0" if dispatched else None
    return jobs


def _formatter(tiny_model_dir: Path, prompts: list[list[int]], k: int) -> ResponseFormatter:
    fmt = ResponseFormatter("completions", "m", AutoTokenizer.from_pretrained(tiny_model_dir),
                            None)
    fmt.start([PromptEcho(ids) for ids in prompts for _ in range(k)], k)
    return fmt


def test_a_client_gone_before_its_first_token_is_charged_its_prompts(
        tiny_model_dir: Path) -> None:
    prompts, k = [[5] * 30, [6] * 12], 3
    fmt = _formatter(tiny_model_dir, prompts, k)  # no chunk came back: it counted nothing
    assert (fmt.prompt_tokens, fmt.completion_tokens) == (0, 0)
    assert _used_tokens(_jobs(prompts, k, dispatched=True), fmt, k) == (42, 0)
    assert _used_tokens(_jobs(prompts, k, dispatched=False), fmt, k) == (0, 0)


def test_tokens_held_for_a_whole_response_are_charged(tiny_model_dir: Path) -> None:
    prompts, k = [[5] * 30], 2
    jobs = _jobs(prompts, k, dispatched=True)
    jobs[0].held_tokens, jobs[1].held_tokens = 7, 4
    assert _used_tokens(jobs, _formatter(tiny_model_dir, prompts, k), k) == (30, 11)
