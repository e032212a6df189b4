"""`loragate serve` without --model serves SmolLM2-135M-Instruct from $LORAGATE_HOME, and the
official openai client gets the engine's greedy answers through the gateway."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from engine.default_model import DEFAULT_MODEL_NAME
from engine.request import RequestOutput
from gateway.demo_adapters import complete_adapters
from tests.live_servers import start_serve
from tests.real_model.conftest import MAX_TOKENS, NUM_KV_BLOCKS, QUESTIONS


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


ASKED = 2  # of QUESTIONS: each answer is a dozen decode steps of a 30-layer model on a CPU


def test_serve_without_model_answers_like_the_engine(
        smollm2_dir: Path, loragate_home: Path, tmp_path: Path,
        answers: list[tuple[list[int], RequestOutput]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAGATE_HOME", str(loragate_home))  # the child finds the model here
    server = start_serve(tmp_path, "--num-kv-blocks", str(NUM_KV_BLOCKS))
    try:
        server.wait_ready()
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120.0) as client:
            # The base model, and the demo adapters trained beside it so far (this suite
            # trains them for its adapter tests; `serve` registers what it finds there).
            trained = sorted(complete_adapters(smollm2_dir / "adapters"))
            assert [m.id for m in client.models.list()] == [DEFAULT_MODEL_NAME, *trained]
            for question, (_, out) in zip(QUESTIONS[:ASKED], answers[:ASKED], strict=True):
                reply = client.chat.completions.create(
                    model=DEFAULT_MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0,
                    messages=[{"role": "user", "content": question}])
                choice = reply.choices[0]
                assert (choice.message.content, choice.finish_reason) == (out.text, "stop")
            # Structured output as the openai SDK asks for it: a pydantic model, parsed back.
            parsed = client.chat.completions.parse(
                model=DEFAULT_MODEL_NAME, max_tokens=80, temperature=0, response_format=City,
                messages=[{"role": "user", "content": "Name the capital of France as JSON."}])
            city = parsed.choices[0].message.parsed
            assert isinstance(city, City) and parsed.choices[0].finish_reason == "stop"
        # Dense text (a markdown rule: 64 '#' a token) that fits the context is counted,
        # not refused for its length: 200,000 characters, about 3,100 of its 8,192 tokens.
        rule = "#" * 200_000
        counted = httpx.post(server.url + "/tokenize", timeout=60.0,
                             json={"prompt": rule, "add_special_tokens": False})
        assert counted.status_code == 200, counted.text
        want = AutoTokenizer.from_pretrained(smollm2_dir)(rule, add_special_tokens=False)
        assert counted.json()["tokens"] == want["input_ids"]
        assert counted.json()["count"] < counted.json()["max_model_len"]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
