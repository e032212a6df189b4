"""Train a demo style adapter (shout, json, brief) on a local model with PEFT, offline.

The data is the model's own: lora/demo_data.py makes the questions, the base model answers
them greedily, and the style rewrites each answer. The adapter therefore learns the style
only, which a few dozen optimizer steps of a rank-8 LoRA on the attention projections can
do. The loss covers the answer tokens and the end-of-turn marker after them (so the adapter
learns where to stop), never the prompt. Uses transformers + PEFT, not the engine: the
result is an ordinary PEFT directory that any PEFT user, and loragate, can load.

Speed on a CPU: the LoRA patches only the top ``top_layers`` decoder layers. The layers
below are frozen and see no adapter, so their output for an example never changes: it is
computed once (``_frozen_prefix``) and every step runs only the top layers forward and
backward, and the lm_head only where a target token is predicted.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lora.demo_data import STYLES, split_questions
from lora.targets import SUPPORTED_MODULES


@dataclass(frozen=True)
class DemoTrainingConfig:
    """How to train one demo adapter."""

    style: str
    """One of lora.demo_data.STYLES: shout, json or brief."""
    steps: int = 30
    """Optimizer steps."""
    batch_size: int = 8
    """Examples per step."""
    learning_rate: float = 3e-3
    """AdamW learning rate, constant after a 5-step linear warm-up."""
    rank: int = 8
    """LoRA rank r."""
    lora_alpha: int = 16
    """LoRA alpha (scaling = alpha / r)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Modules the adapter patches (a subset of lora.targets.SUPPORTED_MODULES)."""
    top_layers: int = 6
    """The adapter patches the last this many decoder layers (all of them if the model has
    fewer): a style is a matter of the output end, and frozen lower layers run once per
    example instead of once per step."""
    num_questions: int = 96
    """Training questions; the rest of lora.demo_data.all_questions() stay held out."""
    max_answer_tokens: int = 32
    """Longest base-model answer generated per question."""
    seed: int = 0
    """Seeds the question split, batch order and LoRA init: same seed, same adapter."""
    threads: int = 2
    """torch intra-op threads while training."""
    log_every: int = 10
    """A progress line every this many steps."""

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"style must be one of {', '.join(STYLES)}, got {self.style!r}")
        for name in ("steps", "batch_size", "rank", "lora_alpha", "num_questions",
                     "max_answer_tokens", "threads", "log_every", "top_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 < self.learning_rate < 1:
            raise ValueError(f"learning_rate must be in (0, 1), got {self.learning_rate}")
        bad = [m for m in self.target_modules if m not in SUPPORTED_MODULES]
        if bad or not self.target_modules:
            raise ValueError(f"target_modules must be a non-empty subset of "
                             f"{SUPPORTED_MODULES}, got {self.target_modules}")

    @classmethod
    def for_style(cls, style: str, **overrides: Any) -> DemoTrainingConfig:
        """The recipe a style is trained with by default (STYLE_RECIPES), then overrides."""
        return cls(style=style, **{**STYLE_RECIPES.get(style, {}), **overrides})


STYLE_RECIPES: dict[str, dict[str, Any]] = {
    # Upper-case English is split into rarer, shorter tokens than the same words in lower
    # case: the adapter has to change what the MLPs of more layers produce, not only where
    # the top layers attend. With the default recipe a 135M model writes capitals but loses
    # its words ("THE CAPITAL OF FRANCAISAIS ..."); with this one it keeps them.
    "shout": {"top_layers": 12, "steps": 40, "target_modules": SUPPORTED_MODULES},
}
"""style -> the fields where its default recipe differs from DemoTrainingConfig's defaults."""


@dataclass(frozen=True)
class Example:
    """One training sequence: prompt_ids + answer_ids, loss on answer_ids only."""

    question: str
    answer: str
    prompt_ids: list[int]
    answer_ids: list[int]


@dataclass(frozen=True)
class TrainingReport:
    """What train_demo_adapter did."""

    out: Path
    examples: list[Example]
    losses: list[float]
    """Mean answer-token loss of each step's batch."""
    data_seconds: float
    train_seconds: float
    held_out: list[str] = field(default_factory=list)
    """Questions not trained on, for trying the adapter."""
    base_answers: dict[str, str] = field(default_factory=dict)
    """question -> the base model's own answer, before the style: every style is trained on
    the same answers, so the next style's training can take them instead of generating."""


def chat_prompt(tokenizer: Any, question: str) -> str:
    """The question as one user turn in the model's chat template, ready for the answer."""
    return str(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             tokenize=False, add_generation_prompt=True))


def encode_example(tokenizer: Any, question: str, answer: str) -> Example:
    """Tokenize as the gateway does: the rendered prompt without added special tokens, then
    whatever the template puts after the assistant's answer (its end-of-turn marker)."""
    prompt = chat_prompt(tokenizer, question)
    full = str(tokenizer.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        tokenize=False))
    if not full.startswith(prompt):
        raise ValueError("the chat template renders an answered turn that does not start "
                         "with the generation prompt; cannot split prompt from answer")
    encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return Example(question, answer, encode(prompt), encode(full[len(prompt):]))


@torch.no_grad()
def generate_answers(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int,
                     batch_size: int = 32) -> list[str]:
    """Greedy answers of ``model`` to chat-rendered prompts, special tokens removed."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues from the right edge of each row
    answers: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(list(prompts[start:start + batch_size]), return_tensors="pt",
                              padding=True, add_special_tokens=False)
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            new = out[:, batch["input_ids"].shape[1]:]  # [B, <= max_new_tokens]
            answers += [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = side
    return answers


def build_examples(tokenizer: Any, answers: Mapping[str, str], questions: Sequence[str],
                   style: str) -> list[Example]:
    """The base model's answers to ``questions`` rewritten in ``style``, tokenized; questions
    whose rewritten answer is empty are dropped."""
    examples = []
    for question in questions:
        answer = answers[question]
        target = STYLES[style](answer) if answer else ""
        if target:
            examples.append(encode_example(tokenizer, question, target))
    return examples


def base_answers(model: Any, tokenizer: Any, questions: Sequence[str], max_answer_tokens: int,
                 known: Mapping[str, str] | None = None) -> dict[str, str]:
    """question -> the base model's greedy answer, generating only those not in ``known``
    (answers of an earlier style's training, made with the same max_answer_tokens)."""
    answers = {q: known[q] for q in questions if known and q in known}
    todo = [q for q in questions if q not in answers]
    if todo:
        generated = generate_answers(model, tokenizer, [chat_prompt(tokenizer, q) for q in todo],
                                     max_answer_tokens)
        answers.update(zip(todo, generated, strict=True))
    return answers


@contextmanager
def _only_layers(causal: Any, start: int, stop: int, final_norm: bool) -> Iterator[Any]:
    """The decoder of ``causal`` running only layers [start, stop) (and its final norm only
    if final_norm): fed the hidden states entering layer ``start`` as inputs_embeds, it
    returns what the full model computes at layer ``stop``. The decoders of the supported
    families apply their layers in list order with masks and rotary embeddings computed
    from positions alone, so a slice of the list is a slice of the computation."""
    inner = causal.model
    layers, norm = inner.layers, inner.norm
    inner.layers = torch.nn.ModuleList(list(layers)[start:stop])
    if not final_norm:
        inner.norm = torch.nn.Identity()
    try:
        yield inner
    finally:
        inner.layers, inner.norm = layers, norm


def _padded(rows: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and attention mask, both [B, T]: every row keeps positions
    0..len-1 and attends to nothing after its end."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return ids, mask


@torch.no_grad()
def _frozen_prefix(causal: Any, examples: Sequence[Example], first: int,
                   batch_size: int = 16) -> list[torch.Tensor]:
    """Hidden states entering layer ``first`` for every example, [T_i, H] each."""
    out: list[torch.Tensor] = []
    for start in range(0, len(examples), batch_size):
        rows = [e.prompt_ids + e.answer_ids for e in examples[start:start + batch_size]]
        ids, mask = _padded(rows)
        with _only_layers(causal, 0, first, final_norm=False) as inner:
            hidden = inner(input_ids=ids, attention_mask=mask, use_cache=False
                           ).last_hidden_state  # [B, T, H]
        out += [hidden[i, :len(row)].clone() for i, row in enumerate(rows)]
    return out


def batch_loss(causal: Any, examples: Sequence[Example], prefix: Sequence[torch.Tensor],
               first: int) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens of a batch, from the cached hidden states
    entering layer ``first`` (prefix[i] is example i's, [T_i, H]).

    Logits are computed only where a target is predicted: the lm_head over a large
    vocabulary at every position would cost as much as several layers."""
    ids, mask = _padded([e.prompt_ids + e.answer_ids for e in examples])  # [B, T]
    hidden_in = torch.zeros(*ids.shape, prefix[0].shape[-1])  # [B, T, H]
    for i, h in enumerate(prefix):
        hidden_in[i, :h.shape[0]] = h
    # Token j of an answer is predicted by the hidden state one position before it.
    at = [(i, len(e.prompt_ids) + j - 1) for i, e in enumerate(examples)
          for j in range(len(e.answer_ids))]
    rows_at, cols_at = (torch.tensor(x) for x in zip(*at, strict=True))  # [N] each
    targets = ids[rows_at, cols_at + 1]  # [N]
    with _only_layers(causal, first, len(causal.model.layers), final_norm=True) as inner:
        hidden = inner(inputs_embeds=hidden_in, attention_mask=mask, use_cache=False
                       ).last_hidden_state  # [B, T, H]
    logits = causal.lm_head(hidden[rows_at, cols_at])  # [N, V]
    return torch.nn.functional.cross_entropy(logits.float(), targets)


def train_demo_adapter(model_dir: str | Path, out: str | Path, config: DemoTrainingConfig,
                       log: Callable[[str], None] = print,
                       known_answers: Mapping[str, str] | None = None) -> TrainingReport:
    """Generate the style's data with the base model, train a LoRA on it, save it to ``out``
    (adapter_config.json + adapter_model.safetensors). known_answers: the base_answers of an
    earlier report on the same model with the same max_answer_tokens, reused."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        started = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        base.eval()  # no dropout anywhere: the same seed gives the same adapter
        train_q, held_out = split_questions(config.num_questions, config.seed)
        todo = len([q for q in train_q if not known_answers or q not in known_answers])
        if todo:
            log(f"answering {todo} questions with the base model "
                f"(max {config.max_answer_tokens} tokens each)")
        answers = base_answers(base, tokenizer, train_q, config.max_answer_tokens,
                               known_answers)
        examples = build_examples(tokenizer, answers, train_q, config.style)
        if len(examples) < config.batch_size:
            raise ValueError(f"only {len(examples)} usable examples for style "
                             f"{config.style!r}; need at least batch_size={config.batch_size}")
        data_seconds = time.perf_counter() - started
        log(f"{len(examples)} examples in {data_seconds:.1f} s, e.g. "
            f"{examples[0].question!r} -> {examples[0].answer!r}")

        num_layers = len(base.model.layers)
        first = max(0, num_layers - config.top_layers)
        prefix = _frozen_prefix(base, examples, first)
        torch.manual_seed(config.seed)
        model = get_peft_model(base, LoraConfig(
            r=config.rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, bias="none",
            target_modules=list(config.target_modules),
            layers_to_transform=list(range(first, num_layers))))
        log(f"training a rank-{config.rank} LoRA on {', '.join(config.target_modules)} of "
            f"layers {first}-{num_layers - 1} for {config.steps} steps")
        losses = _train(model, examples, prefix, first, config, log)
        train_seconds = time.perf_counter() - started - data_seconds
        model.save_pretrained(str(out))
        log(f"adapter written to {out} ({train_seconds:.1f} s of training, "
            f"final loss {losses[-1]:.3f})")
        return TrainingReport(Path(out), examples, losses, data_seconds, train_seconds,
                              held_out, answers)
    finally:
        torch.set_num_threads(threads)


def _train(model: Any, examples: list[Example], prefix: list[torch.Tensor], first: int,
           config: DemoTrainingConfig, log: Callable[[str], None]) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    rng = random.Random(config.seed)
    order: list[int] = []
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    for step in range(1, config.steps + 1):
        if len(order) < config.batch_size:  # a fresh shuffle per epoch
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order += epoch
        batch, order = order[:config.batch_size], order[config.batch_size:]
        loss = batch_loss(model.get_base_model(), [examples[i] for i in batch],
                          [prefix[i] for i in batch], first)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        warmup.step()
        losses.append(loss.item())
        if step % config.log_every == 0 or step == config.steps:
            recent = losses[-config.log_every:]
            log(f"step {step}/{config.steps}  loss {sum(recent) / len(recent):.3f}  "
                f"({time.perf_counter() - started:.0f} s)")
    model.eval()
    return losses
