"""Engine tokens and log-probs against transformers, under chunking and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.llm_engine import LLMEngine
from tests.parity import (
    check_against_reference,
    load_reference,
    random_workload,
    run_workload,
    shared_prefix_workload,
)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_random_workload_matches_transformers(tiny_model_dir: Path, preemption_mode: str
                                              ) -> None:
    # 40 blocks of 16 = 640 tokens for up to ~150 concurrent requests of up to 324 tokens:
    # preemption is certain; a 64-token budget chunks every prompt longer than 64.
    engine = LLMEngine.from_model(
        str(tiny_model_dir), num_kv_blocks=40, block_size=16, max_num_batched_tokens=64,
        max_num_seqs=16, preemption_mode=preemption_mode, swap_space_bytes=1 << 20)
    items = random_workload(150, seed=1 if preemption_mode == "swap" else 0)
    outputs = run_workload(engine, items)

    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and engine.kv.swap_pool.num_free == (
        engine.kv.swap_pool.num_blocks)
    assert len(outputs) == len(items)
    ref = load_reference(tiny_model_dir)
    for item in items:
        out = outputs[item.request_id]
        assert len(out.token_ids) == item.max_tokens
        check_against_reference(ref, item.prompt, out)


@pytest.mark.parametrize("chunked", [True, False])
def test_prefix_caching_on_and_off_agree(tiny_model_dir: Path, chunked: bool) -> None:
    items = shared_prefix_workload(80, seed=11)
    # 30 blocks of 16 for prompts up to ~190 tokens: preemption while holding cached blocks.
    common = dict(num_kv_blocks=30, block_size=16, max_num_seqs=12,
                  max_num_batched_tokens=48 if chunked else 512,
                  enable_chunked_prefill=chunked, max_model_len=512)
    runs = {}
    for mode in ("off", "on"):
        engine = LLMEngine.from_model(str(tiny_model_dir), prefix_caching=mode, **common)
        runs[mode] = run_workload(engine, items)
        stats = engine.stats()
        assert stats.num_preemptions > 0
        assert stats.kv_blocks_used == 0
        if mode == "on":
            # Hits are whole blocks, so they end mid-chunk whenever the 48-token budget
            # does not divide them.
            assert stats.prefix_cache.hit_tokens > 2000
            assert engine.kv.pool.num_cached > 0
        else:
            assert stats.prefix_cache.hit_tokens == 0
    ref = load_reference(tiny_model_dir)
    for item in items:
        on, off = runs["on"][item.request_id], runs["off"][item.request_id]
        assert on.token_ids == off.token_ids
        check_against_reference(ref, item.prompt, on)


def test_chunked_prefill_off_matches_transformers(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_model(
        str(tiny_model_dir), num_kv_blocks=64, max_num_batched_tokens=1024,
        enable_chunked_prefill=False)
    items = random_workload(20, seed=3, max_prompt=200)
    outputs = run_workload(engine, items)
    ref = load_reference(tiny_model_dir)
    for item in items:
        check_against_reference(ref, item.prompt, outputs[item.request_id])


def test_bfloat16_close_to_transformers_bfloat16(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_model(str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=64,
                                  max_num_batched_tokens=64)
    assert engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    items = random_workload(8, seed=4, max_prompt=100, max_output=8)
    outputs = run_workload(engine, items)
    ref = load_reference(tiny_model_dir, torch.bfloat16)
    for item in items:
        # bf16 keeps 8 mantissa bits: op-order differences reach a few hundredths.
        check_against_reference(ref, item.prompt, outputs[item.request_id], atol=0.08,
                                check_greedy=False)


def _write_variant(tiny_model_dir: Path, out: Path, kind: str) -> Path:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.05,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(7)
    if kind == "qwen2":
        qwen = Qwen2ForCausalLM(Qwen2Config(**common))
        # Random init leaves biases at zero; make them matter.
        for layer in qwen.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.1)
        model: PreTrainedModel = qwen
    else:
        model = MistralForCausalLM(MistralConfig(sliding_window=40, **common))
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_other_llama_family_models(tiny_model_dir: Path, tmp_path: Path, kind: str) -> None:
    model_dir = _write_variant(tiny_model_dir, tmp_path / kind, kind)
    engine = LLMEngine.from_model(str(model_dir), num_kv_blocks=64, max_num_batched_tokens=48)
    # Prompts longer than the Mistral window (40) exercise the sliding-window masks in
    # prefill chunks and in decode.
    items = random_workload(12, seed=5, max_prompt=120, max_output=16)
    outputs = run_workload(engine, items)
    ref = load_reference(model_dir)
    for item in items:
        check_against_reference(ref, item.prompt, outputs[item.request_id])
