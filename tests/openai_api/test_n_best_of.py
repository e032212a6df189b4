"""n and best_of through the live gateway with the official `openai` client: n choices per
prompt (index = prompt's place * n + j), each seeded sequence reproducible on its own,
streamed interleaved; best_of keeps the most likely; usage counts each prompt once."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.live_servers import LiveServer
from tests.openai_api.helpers import MESSAGES, NO_EOS, PROMPT


def test_n_choices_are_independent_seeded_samples(client: openai.OpenAI,
                                                  base_model: str) -> None:
    args: dict[str, Any] = {"model": base_model, "max_tokens": 6, "temperature": 1.0,
                            "seed": 42, "extra_body": NO_EOS}
    done = client.completions.create(prompt=PROMPT, n=3, **args)
    assert [c.index for c in done.choices] == [0, 1, 2]
    texts = [c.text for c in done.choices]
    assert len(set(texts)) > 1
    # Sequence j draws with seed + j: the first is what n=1 with the same seed gives.
    single = client.completions.create(prompt=PROMPT, **args)
    assert single.choices[0].text == texts[0]
    assert done.usage is not None and single.usage is not None
    assert done.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once
    assert done.usage.completion_tokens == 18
    chat = client.chat.completions.create(model=base_model, messages=MESSAGES, n=2,
                                          max_tokens=4, temperature=1.0, seed=1,
                                          extra_body=NO_EOS)
    assert [c.index for c in chat.choices] == [0, 1]
    many = client.chat.completions.create(model=base_model, messages=MESSAGES, n=128,
                                          max_tokens=1, temperature=1.0, seed=2,
                                          extra_body=NO_EOS)  # OpenAI's bound on n
    assert [c.index for c in many.choices] == list(range(128))
    assert many.usage is not None and many.usage.completion_tokens == 128


def test_n_with_a_batch_and_streaming(client: openai.OpenAI, base_model: str) -> None:
    args: dict[str, Any] = {"model": base_model, "prompt": ["one two", "three four"],
                            "n": 2, "max_tokens": 5, "temperature": 0.9, "seed": 7,
                            "extra_body": NO_EOS}
    whole = client.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    texts = [""] * 4
    for event in client.completions.create(**args, stream=True):
        for choice in event.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]


def test_best_of_keeps_the_most_likely(client: openai.OpenAI, base_model: str) -> None:
    args: dict[str, Any] = {"model": base_model, "prompt": PROMPT, "max_tokens": 6,
                            "temperature": 1.0, "seed": 3, "extra_body": NO_EOS}
    every = client.completions.create(n=4, logprobs=0, **args)

    def total(choice: Any) -> float:
        return sum(lp for lp in choice.logprobs.token_logprobs if lp is not None)
    best = max(every.choices, key=total)
    kept = client.completions.create(n=1, best_of=4, **args)
    [choice] = kept.choices
    assert choice.text == best.text and choice.index == 0
    assert choice.logprobs is None  # ranked by logprobs the client did not ask for
    assert kept.usage is not None and kept.usage.completion_tokens == 24


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "n": 3, "best_of": 2},
    {"prompt": "hi", "best_of": 3, "stream": True},
    {"prompt": ["a"] * 20, "n": 8},        # 160 sequences
    {"prompt": "hi", "n": True},
])
def test_bad_sample_counts_are_400(gateway: LiveServer, base_model: str,
                                   body: dict[str, Any]) -> None:
    answer = httpx.post(gateway.url + "/v1/completions", timeout=30.0,
                        json={"model": base_model, "max_tokens": 2, **body})
    assert answer.status_code == 400, answer.text
