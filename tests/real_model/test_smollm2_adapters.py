"""The demo style adapters on the real model: one batch that mixes the base model and the
three styles answers in four visibly different ways, the engine's adapter tokens are PEFT's
argmax (teacher-forced), and the gateway serves the same answers to the official client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from peft import PeftModel

from engine.llm import LLM
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from lora.demo_data import split_questions
from lora.demo_training import DemoTrainingConfig
from tests.live_servers import running, start_serve
from tests.parity import check_against_reference, load_reference
from tests.real_model.conftest import NUM_KV_BLOCKS, chat_prompt

pytestmark = pytest.mark.timeout(3600)  # the first run trains three adapters (minutes)

MODELS = (None, "shout", "json", "brief")
"""None: the base model."""
MAX_TOKENS = 40


def held_out_questions(count: int) -> list[str]:
    """Questions the demo adapters were not trained on."""
    config = DemoTrainingConfig(style="json")
    return split_questions(config.num_questions, config.seed)[1][:count]


QUESTIONS = held_out_questions(3)


@pytest.fixture(scope="module")
def mixed_batch(smollm2_dir: Path, demo_adapter_dir: Path
                ) -> dict[tuple[str | None, str], tuple[list[int], RequestOutput]]:
    """(model, question) -> (prompt ids, greedy output): every question under every model,
    all in one engine batch."""
    llm = LLM(str(smollm2_dir), device="cpu", num_kv_blocks=NUM_KV_BLOCKS, max_lora_rank=8)
    for style in MODELS[1:]:
        assert style is not None
        llm.load_lora(style, str(demo_adapter_dir / style))
    cases = [(model, q) for q in QUESTIONS for model in MODELS]
    prompts = [chat_prompt(smollm2_dir, q) for _, q in cases]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                logprobs=1),
                        lora=[m for m, _ in cases], use_tqdm=False)
    return {case: (prompt, out) for case, prompt, out in zip(cases, prompts, outs, strict=True)}


def upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def test_one_batch_answers_in_four_styles(
        mixed_batch: dict[tuple[str | None, str], tuple[list[int], RequestOutput]]) -> None:
    for question in QUESTIONS:
        text = {model: mixed_batch[model, question][1].text for model in MODELS}
        print(question, json.dumps(text, indent=1))
        assert len(set(text.values())) == len(MODELS), text  # four different answers
        assert upper_share(text["shout"]) >= 0.9, text["shout"]
        assert upper_share(text[None]) < 0.5, text[None]
        answer = json.loads(text["json"])  # the whole answer is one JSON object
        assert list(answer) == ["answer"] and isinstance(answer["answer"], str), answer
        with pytest.raises(ValueError):
            json.loads(text[None])
        # brief: one sentence, ended by the model itself; longer answers have more.
        brief = mixed_batch["brief", question][1]
        assert brief.finish_reason == "stop", brief.text
        assert sum(brief.text.count(end) for end in ".!?") <= 1, brief.text


def test_adapter_tokens_are_peft_argmax(
        smollm2_dir: Path, demo_adapter_dir: Path,
        mixed_batch: dict[tuple[str | None, str], tuple[list[int], RequestOutput]]) -> None:
    base = load_reference(smollm2_dir)
    for style in ("json", "shout"):
        # PEFT applies the adapter to the reference model; unload it before the next style.
        reference = PeftModel.from_pretrained(base, str(demo_adapter_dir / style)).eval()
        for question in QUESTIONS[:2]:
            prompt, out = mixed_batch[style, question]
            check_against_reference(reference, prompt, out)
        base = reference.unload()


def test_gateway_serves_the_styles_batched(
        smollm2_dir: Path, demo_adapter_dir: Path, tmp_path: Path,
        mixed_batch: dict[tuple[str | None, str], tuple[list[int], RequestOutput]]) -> None:
    question = QUESTIONS[0]
    loras = [arg for style in MODELS[1:]
             for arg in ("--lora", f"{style}={demo_adapter_dir / style}")]
    server = start_serve(tmp_path, "--model", str(smollm2_dir), "--num-kv-blocks",
                         str(NUM_KV_BLOCKS), *loras)
    with running(server), openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                                        max_retries=0, timeout=300.0) as client:
        served = sorted(m.id for m in client.models.list())
        assert served == sorted([smollm2_dir.name, "brief", "json", "shout"])

        def ask(model: str | None) -> str | None:
            reply = client.chat.completions.create(
                model=model or smollm2_dir.name, max_tokens=MAX_TOKENS, temperature=0,
                messages=[{"role": "user", "content": question}])
            return reply.choices[0].message.content

        # Sent at once, so the engine runs them in one batch as the offline test did.
        with ThreadPoolExecutor(len(MODELS)) as pool:
            replies = list(pool.map(ask, MODELS))
    assert replies == [mixed_batch[model, question][1].text for model in MODELS]
