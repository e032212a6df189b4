"""A seeded, random-weight Llama checkpoint with a real trained tokenizer, fully offline.

The tokenizer is a byte-level BPE trained on the English help text that ships with every
CPython (pydoc_data.topics), so it needs no download and is the same on every machine with
the same Python minor version. The result is an ordinary Hugging Face directory that
transformers itself loads.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from engine.demo_shapes import DemoModelSpec

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

# ChatML: the gateway renders chat requests with the tokenizer's own template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)




def training_corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_demo_model(out_dir: str | Path, spec: DemoModelSpec | None = None) -> Path:
    """Write tokenizer, config, generation config and safetensors weights into out_dir."""
    spec = spec or DemoModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size)
    tokenizer.save_pretrained(str(out))
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[eos_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(str(out))
    (out / "loragate_demo.json").write_text(repr(asdict(spec)) + "\n")
    return out


DEMO_TARGETS = (
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)


def make_peft_adapter(base_dir: str | Path, out_dir: str | Path, rank: int,
                      target_modules: tuple[str, ...], seed: int, lora_alpha: int | None = None,
                      use_rslora: bool = False, b_scale: float = 1.0,
                      rank_pattern: dict[str, int] | None = None,
                      alpha_pattern: dict[str, float] | None = None) -> Path:
    """Write a seeded random LoRA adapter for base_dir, made by PEFT itself.

    PEFT initialises B to zeros (a no-op adapter); with init_lora_weights=False both A and B
    are random, so the adapter really changes outputs. b_scale shrinks B to keep the model's
    outputs in a sane range. rank_pattern / alpha_pattern give some modules a rank / alpha of
    their own, as in LoraConfig.
    """
    from peft import LoraConfig, get_peft_model

    base = LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=lora_alpha if lora_alpha is not None else 2 * rank,
                        target_modules=list(target_modules), init_lora_weights=False,
                        use_rslora=use_rslora, lora_dropout=0.0,
                        rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {})
    peft_model = get_peft_model(base, config)
    if b_scale != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(b_scale)
    out = Path(out_dir)
    peft_model.save_pretrained(str(out))
    return out


def make_demo_adapters(model_dir: str | Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` adapters under model_dir/adapters/demo-<i>, ranks alternating 8 and 16."""
    return [
        make_peft_adapter(model_dir, Path(model_dir) / "adapters" / f"demo-{i}",
                          rank=8 if i % 2 == 0 else 16,
                          target_modules=DEMO_TARGETS[i % len(DEMO_TARGETS)],
                          seed=seed + 1000 + i, b_scale=0.2)
        for i in range(count)
    ]
