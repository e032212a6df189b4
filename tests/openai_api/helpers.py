"""Constants of the package's live gateway and helpers shared by its test modules."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
from transformers import PreTrainedTokenizerBase

from tests.live_servers import LiveServer

CONTEXT = 1024  # the tiny model's max_position_embeddings
MAX_TOKENS = 12
NO_EOS = {"ignore_eos": True}  # finish_reason "length" and exact token counts
PROMPT = "The quick brown fox"
MESSAGES: list[Any] = [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "hello world"}]
DEADLINE_S = 20.0
GREEDY: dict[str, Any] = {"temperature": 0}
SEEDED: dict[str, Any] = {"temperature": 0.8, "seed": 1234}


def wait_engine_idle(engine_url: str) -> dict[str, Any]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        state: dict[str, Any] = httpx.get(engine_url + "/state", timeout=5.0).json()
        if (state["num_running"], state["num_waiting"], state["kv_blocks_used"],
                state["in_flight"]) == (0, 0, 0, 0):
            return state
        assert time.monotonic() < deadline, f"engine not idle: {state}"
        time.sleep(0.02)


def assert_healthy(gateway: LiveServer, client: openai.OpenAI, base_model: str) -> None:
    assert httpx.get(gateway.url + "/health").json() == {"status": "ready",
                                                         "ready_instances": 1}
    done = client.completions.create(model=base_model, prompt="hi", max_tokens=2,
                                     extra_body=NO_EOS)
    assert done.usage is not None and done.usage.completion_tokens == 2


def chat_prompt_tokens(tokenizer: PreTrainedTokenizerBase, messages: list[Any]) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return len(ids)


def model_name(name: str, base_model: str) -> str:
    return base_model if name == "base" else name
