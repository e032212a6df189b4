"""Echo, prompt logprobs and batched prompts through the live gateway and engine, read with
the official `openai` client: the loglikelihood requests lm-evaluation-harness sends (a batch
of token-id prompts, echo, logprobs 1, max_tokens 1 or 0) give transformers' logprobs for
every prompt token, and a batch answers as its prompts would one by one."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from tests.live_servers import LiveServer
from tests.openai_api.helpers import GREEDY, MESSAGES, NO_EOS, PROMPT, wait_engine_idle
from tests.parity import FP32_LOGPROB_ATOL, NEAR_TIE, load_reference


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


@torch.inference_mode()
def _reference_logprobs(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the distribution of the token after ids[:i + 1]."""
    return ref(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def test_lm_eval_loglikelihood_batch_matches_transformers(
        client: openai.OpenAI, base_model: str, reference: torch.nn.Module) -> None:
    # What lm-eval's local-completions sends for loglikelihood requests (batch_size 3).
    prompts = [_ids(1, 40), _ids(2, 7), _ids(3, 90)]
    done = client.completions.create(model=base_model, prompt=prompts, echo=True,
                                     logprobs=1, max_tokens=1, temperature=0, seed=1234)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert done.usage is not None
    assert done.usage.prompt_tokens == sum(map(len, prompts))
    assert done.usage.completion_tokens == 3
    for prompt, choice in zip(prompts, done.choices, strict=True):
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.token_logprobs) == len(prompt) + 1  # the prompt, then one token
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = _reference_logprobs(reference, prompt)
        for pos in range(1, len(prompt)):
            got = lp.token_logprobs[pos]
            assert got is not None
            assert abs(got - float(want[pos - 1, prompt[pos]])) <= FP32_LOGPROB_ATOL
            # logprobs=1: the most likely token, and the prompt's own (as OpenAI: up to 2;
            # keyed by text, so two tokens that decode alike share a key).
            top = lp.top_logprobs[pos]
            assert len(top) <= 2 and lp.tokens is not None and lp.tokens[pos] in top
            assert abs(max(top.values()) - float(want[pos - 1].max())) <= FP32_LOGPROB_ATOL
        # The generated token is greedy and last: what lm-eval's [ctxlen:-1] slice drops.
        last = lp.token_logprobs[-1]
        assert last is not None
        assert last >= float(want[-1].max()) - NEAR_TIE


def test_echo_with_max_tokens_0_returns_the_prompt_alone(
        client: openai.OpenAI, base_model: str, tokenizer: PreTrainedTokenizerBase) -> None:
    done = client.completions.create(model=base_model, prompt=PROMPT, echo=True, logprobs=2,
                                     max_tokens=0)
    [choice] = done.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    ids = tokenizer(PROMPT)["input_ids"]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(ids)
    assert "".join(lp.tokens) == tokenizer.decode(ids)
    assert lp.text_offset[0] == 0
    assert done.usage is not None and done.usage.completion_tokens == 0


def test_echo_prepends_the_prompt_streamed_or_not(client: openai.OpenAI,
                                                  base_model: str) -> None:
    args: dict[str, Any] = {"model": base_model, "prompt": PROMPT, "echo": True,
                            "max_tokens": 5, "logprobs": 1, "extra_body": NO_EOS, **GREEDY}
    whole = client.completions.create(**args)
    plain = client.completions.create(**{**args, "echo": False})
    assert whole.choices[0].text == PROMPT + plain.choices[0].text
    streamed = list(client.completions.create(**args, stream=True))
    assert streamed[0].choices[0].text.startswith(PROMPT)
    assert "".join(e.choices[0].text for e in streamed) == whole.choices[0].text
    tokens = [t for e in streamed for t in (e.choices[0].logprobs.tokens or [])
              if e.choices[0].logprobs is not None]
    assert whole.choices[0].logprobs is not None
    assert tokens == whole.choices[0].logprobs.tokens


def test_a_batch_answers_as_its_prompts_one_by_one(client: openai.OpenAI,
                                                   base_model: str) -> None:
    prompts = ["The quick brown fox", "hello world", "one two three four"]
    args: dict[str, Any] = {"model": base_model, "max_tokens": 6, "extra_body": NO_EOS,
                            **GREEDY}
    batch = client.completions.create(prompt=prompts, **args)
    single = [client.completions.create(prompt=p, **args).choices[0].text for p in prompts]
    assert [c.text for c in batch.choices] == single
    assert batch.usage is not None and batch.usage.completion_tokens == 18
    texts = [""] * 3
    finished = set()
    for event in client.completions.create(prompt=prompts, stream=True,
                                           stream_options={"include_usage": True}, **args):
        for choice in event.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
        if not event.choices:
            assert event.usage is not None and event.usage.completion_tokens == 18
    assert texts == single and finished == {0, 1, 2}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
        client: openai.OpenAI, base_model: str, endpoint: str) -> None:
    # vLLM's stream_options.continuous_usage_stats: each chunk's usage counts its choice's
    # tokens streamed up to it; the last, choice-less chunk has the whole usage as before.
    args: dict[str, Any] = {
        "model": base_model, "max_tokens": 6, "stream": True, "extra_body": NO_EOS,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **GREEDY}
    events = list(client.completions.create(prompt=PROMPT, **args) if endpoint == "completions"
                  else client.chat.completions.create(messages=MESSAGES, **args))
    *chunks, last = events
    assert not last.choices and last.usage is not None and last.usage.completion_tokens == 6
    counts = []
    for chunk in chunks:
        assert chunk.usage is not None
        assert chunk.usage.prompt_tokens == last.usage.prompt_tokens
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + \
            chunk.usage.completion_tokens
        counts.append(chunk.usage.completion_tokens)
    assert counts == sorted(counts) and counts[-1] == 6 and len(chunks) >= 2
    # With n > 1 each chunk counts its own choice's tokens, as vLLM does.
    by_choice: dict[int, list[int]] = {0: [], 1: []}
    *chunks, last = client.completions.create(prompt=PROMPT, n=2, **args)
    assert last.usage is not None and last.usage.completion_tokens == 12
    for chunk in chunks:
        assert chunk.usage is not None and chunk.usage.prompt_tokens == last.usage.prompt_tokens
        by_choice[chunk.choices[0].index].append(chunk.usage.completion_tokens)
    assert all(c == sorted(c) and c[-1] == 6 for c in by_choice.values()), by_choice
    # Without it, the chunks' usage stays null.
    args["stream_options"] = {"include_usage": True}
    plain = list(client.completions.create(prompt=PROMPT, **args))
    assert all(chunk.usage is None for chunk in plain[:-1]) and plain[-1].usage is not None


def test_vllm_prompt_logprobs_on_both_endpoints(
        client: openai.OpenAI, base_model: str, reference: torch.nn.Module) -> None:
    done = client.completions.create(model=base_model, prompt=PROMPT, max_tokens=1,
                                     extra_body={"prompt_logprobs": 2,
                                                 "return_token_ids": True})
    choice = done.choices[0].model_dump()
    ids = choice["prompt_token_ids"]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    want = _reference_logprobs(reference, ids)
    for pos in range(1, len(ids)):
        position = scored[pos]
        actual = position[str(ids[pos])]
        assert abs(actual["logprob"] - float(want[pos - 1, ids[pos]])) <= FP32_LOGPROB_ATOL
        assert actual["rank"] >= 1 and isinstance(actual["decoded_token"], str)
        # The two most likely tokens ranked 1 and 2 (one of them may be the prompt's).
        assert {v["rank"] for k, v in position.items() if k != str(ids[pos])} <= {1, 2}
        assert len(position) in (2, 3)
    chat = client.chat.completions.create(model=base_model, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0}).model_dump()
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"])
    assert chat["prompt_logprobs"][0] is None
    assert all(len(p) == 1 for p in chat["prompt_logprobs"][1:])  # k=0: the token alone


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),
    ({"prompt": ["a"] * 129}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "echo": 1}, "echo"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_bad_echo_and_batch_requests_are_400(gateway: LiveServer, base_model: str,
                                             body: dict[str, Any], param: str) -> None:
    answer = httpx.post(gateway.url + "/v1/completions", json={"model": base_model, **body},
                        timeout=30.0)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_batch_with_one_prompt_too_long_runs_nothing(gateway: LiveServer, base_model: str,
                                                       engine: LiveServer) -> None:
    answer = httpx.post(gateway.url + "/v1/completions", timeout=30.0, json={
        "model": base_model, "prompt": [[5, 6, 7], [5] * 2000], "max_tokens": 2})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"


def test_leaving_a_streamed_batch_aborts_all_its_requests(client: openai.OpenAI,
                                                          base_model: str,
                                                          engine: LiveServer) -> None:
    stream = client.completions.create(model=base_model, prompt=["a b c"] * 4,
                                       max_tokens=400, stream=True, extra_body=NO_EOS)
    first = next(iter(stream))
    assert first.choices
    stream.close()
    wait_engine_idle(engine.url)  # all four requests ended and freed their blocks
