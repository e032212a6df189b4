"""Demo style adapters (`loragate train-adapter`): the data and style transforms, and the
training mechanics on the tiny model (a loadable PEFT directory, the loss falls, loragate
serves it as PEFT computes it). Training on the real model is the slow test at the end."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoTokenizer

from engine.llm_engine import LLMEngine
from engine.models.loader import load_hf_config
from engine.models.shape import ModelShape
from engine.sampling_params import SamplingParams
from gateway.cli import main
from gateway.demo_adapters import RECIPE_FILE, TRAINING_LOCK, recipe, train_missing
from lora.adapter import load_adapter
from lora.demo_data import (
    STYLES,
    all_questions,
    as_json,
    brief,
    complete_sentences,
    first_sentence,
    shout,
    split_questions,
)
from lora.demo_training import (
    DemoTrainingConfig,
    TrainingReport,
    chat_prompt,
    encode_example,
    train_demo_adapter,
)
from tests.parity import check_against_reference, load_reference

ANSWER = "The capital of France is Paris. It is known for the Eiffel Tower and its"


# ------------------------------------------------------------------------------- data
def test_styles_rewrite_an_answer() -> None:
    assert shout(ANSWER) == "THE CAPITAL OF FRANCE IS PARIS."
    assert json.loads(as_json(ANSWER)) == {"answer": "The capital of France is Paris."}
    assert brief(ANSWER) == "The capital of France is Paris."
    assert first_sentence("Pi is 3.14 here! Yes.") == "Pi is 3.14 here!"
    assert complete_sentences("no end at all") == "no end at all"
    assert first_sentence("  one line  ") == "one line"


def test_question_split_is_seeded_and_disjoint() -> None:
    questions = all_questions()
    assert len(questions) == len(set(questions)) == 255
    train, held = split_questions(96, seed=0)
    assert (train, held) == split_questions(96, seed=0)
    assert train != split_questions(96, seed=1)[0]
    assert len(train) == 96 and sorted(train + held) == sorted(questions)
    with pytest.raises(ValueError, match="num_train must be in"):
        split_questions(255, seed=0)


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="style must be one of shout, json, brief"):
        DemoTrainingConfig(style="pirate")
    with pytest.raises(ValueError, match="steps must be a positive integer, got 0"):
        DemoTrainingConfig(style="shout", steps=0)
    with pytest.raises(ValueError, match="target_modules must be a non-empty subset"):
        DemoTrainingConfig(style="shout", target_modules=("lm_head",))


def test_each_style_has_its_recipe() -> None:
    assert DemoTrainingConfig.for_style("json") == DemoTrainingConfig(style="json")
    shout = DemoTrainingConfig.for_style("shout")
    assert (shout.top_layers, shout.steps, len(shout.target_modules)) == (12, 40, 7)
    assert DemoTrainingConfig.for_style("shout", steps=2).steps == 2  # the caller's wins
    # Every style answers the same questions: the base model's answers serve them all.
    assert len({(c.num_questions, c.seed, c.max_answer_tokens) for c in map(
        DemoTrainingConfig.for_style, ("shout", "json", "brief"))}) == 1


def test_example_has_loss_on_answer_and_end_of_turn(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    example = encode_example(tokenizer, "What is tea?", "TEA IS A DRINK.")
    prompt_ids = tokenizer(chat_prompt(tokenizer, "What is tea?"),
                           add_special_tokens=False)["input_ids"]
    assert example.prompt_ids == prompt_ids
    assert tokenizer.decode(example.answer_ids) == "TEA IS A DRINK.<|im_end|>\n"


# ------------------------------------------------------------- training, tiny model
TINY = DemoTrainingConfig(style="json", steps=16, batch_size=4, num_questions=16,
                          max_answer_tokens=8, learning_rate=1e-2, log_every=4)


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainingReport:
    return train_demo_adapter(tiny_model_dir, tmp_path_factory.mktemp("demo") / "json", TINY,
                              log=lambda _: None)


def test_training_writes_a_peft_dir_loragate_loads(trained: TrainingReport,
                                                   tiny_model_dir: Path) -> None:
    assert sorted(p.name for p in trained.out.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]
    shape = ModelShape.from_hf_config(load_hf_config(str(tiny_model_dir)))
    adapter = load_adapter("json", trained.out, shape.lora_targets(), max_rank=8)
    assert adapter.rank == 8 and adapter.alpha == 16.0
    assert adapter.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert sorted({layer for layer, _ in adapter.weights}) == [0, 1]  # top_layers >= 2


def test_training_lowers_the_loss(trained: TrainingReport) -> None:
    # 16 examples, 4 a step: every 4 steps are one pass over the same data.
    assert len(trained.losses) == 16 and len(trained.examples) == 16
    epochs = [sum(trained.losses[i:i + 4]) / 4 for i in range(0, 16, 4)]
    assert epochs == sorted(epochs, reverse=True) and epochs[-1] < 0.95 * epochs[0], epochs


def test_training_is_seeded(trained: TrainingReport, tiny_model_dir: Path,
                            tmp_path: Path) -> None:
    again = train_demo_adapter(tiny_model_dir, tmp_path / "again", TINY, log=lambda _: None)
    digest = lambda p: hashlib.sha256(  # noqa: E731
        (p / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert digest(again.out) == digest(trained.out)
    assert again.losses == trained.losses


def test_loragate_serves_the_trained_adapter_as_peft_does(trained: TrainingReport,
                                                          tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    engine = LLMEngine.from_model(str(tiny_model_dir), max_lora_rank=8, max_model_len=256)
    engine.load_lora("json", str(trained.out))
    prompts = [tokenizer(chat_prompt(tokenizer, q), add_special_tokens=False)["input_ids"]
               for q in trained.held_out[:3]]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, logprobs=3), lora="json")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    reference = PeftModel.from_pretrained(load_reference(tiny_model_dir), str(trained.out))
    for i, prompt in enumerate(prompts):
        check_against_reference(reference, prompt, done[f"q{i}"])


def test_cli_trains_an_adapter(tiny_model_dir: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    # The CLI's defaults are sized for the real model; 2 steps on the tiny one check wiring.
    assert main(["train-adapter", "--model", str(tiny_model_dir), "--style", "shout",
                 "--steps", "2", str(tmp_path / "shout")]) == 0
    out = capsys.readouterr().out
    assert "step 2/2" in out and f"--lora shout={tmp_path / 'shout'}" in out
    assert (tmp_path / "shout" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------- training, real model
REAL_MODEL = os.environ.get("LORAGATE_REAL_MODEL")


@pytest.mark.slow
@pytest.mark.skipif(not REAL_MODEL, reason="set LORAGATE_REAL_MODEL to a SmolLM2-135M-Instruct "
                                           "HF directory (see `loragate import-gguf`)")
def test_shout_adapter_on_the_real_model_answers_in_upper_case(tmp_path: Path) -> None:
    """Minutes on 2 CPU cores: the full default `shout` recipe, then greedy answers to
    questions it never saw are upper case, and the base model's are not."""
    assert REAL_MODEL is not None
    report = train_demo_adapter(REAL_MODEL, tmp_path / "shout",
                                DemoTrainingConfig.for_style("shout"), log=lambda _: None)
    assert report.losses[-1] < report.losses[0]
    tokenizer = AutoTokenizer.from_pretrained(REAL_MODEL)
    engine = LLMEngine.from_model(REAL_MODEL, max_lora_rank=8, max_model_len=512)
    engine.load_lora("shout", str(report.out))
    questions = report.held_out[:4]
    for i, question in enumerate(questions):
        prompt = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False
                           )["input_ids"]
        for lora in ("shout", None):
            engine.add_request(f"{lora}-{i}", prompt, SamplingParams(max_tokens=24,
                                                                     temperature=0), lora=lora)
    done = {}
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    for i in range(len(questions)):
        shouted, plain = done[f"shout-{i}"].text, done[f"None-{i}"].text
        letters = [c for c in shouted if c.isalpha()]
        assert sum(c.isupper() for c in letters) >= 0.9 * len(letters), shouted
        assert plain != plain.upper(), plain


def test_a_second_trainer_waits_for_the_first_and_trains_only_what_is_missing(
        tmp_path: Path) -> None:
    # `loragate serve` trains in the background into the model's directory, which a test
    # suite may share: two trainers must not race on one style.
    adapter_dir = tmp_path / "adapters"
    for style in STYLES:  # every style there already, by today's recipe: nothing to train
        (adapter_dir / style).mkdir(parents=True)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (adapter_dir / style / name).write_text("{}")
        (adapter_dir / style / RECIPE_FILE).write_text(json.dumps(recipe(style)))
    in_progress = adapter_dir / ".shout.partial-abc"  # the first trainer's work
    in_progress.mkdir()
    with open(adapter_dir / TRAINING_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        second = threading.Thread(target=train_missing, args=(tmp_path, adapter_dir))
        second.start()
        second.join(0.5)
        assert second.is_alive()  # waiting for the lock
        assert in_progress.is_dir()  # and not clearing the first one's partial work
    second.join(10.0)
    assert not second.is_alive()
    assert not in_progress.exists()  # left over once the first is gone: cleared
    assert sorted(p.name for p in adapter_dir.iterdir()) == sorted([TRAINING_LOCK, *STYLES])
