"""Every served model family against transformers (and PEFT), on tiny random checkpoints.

Each family's checkpoint is built by transformers itself (from_config with a seed,
save_pretrained) with the tiny demo tokenizer; weights that random init leaves trivial
(biases at zero, norm weights at one, Gemma's norm offsets at zero) are randomised so that a
model ignoring them fails.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention import build_attention_metadata, build_step_metadata
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.loader import load_hf_config
from engine.models.rope import llama3_inv_freq, rope_cos_sin
from engine.models.shape import ModelShape
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from lora.targets import SUPPORTED_MODULES
from tests.parity import check_against_reference, load_reference, shared_prefix_workload

WINDOW = 16
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
"""With head_dim 16 and theta 10000 the wavelengths are 6.3, 19.9, 62.8, 199, ...: one kept
(< 64 / 4), two blended, five stretched: every branch of the llama3 scaling is used."""

GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
"""Local, global, local: both kinds, and a local layer after a global one."""
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
"""As Gemma 3 4B and larger ship it: a scaled global rope, a plain local one of another base."""

FAMILIES = ["llama-tied", "llama3-rope", "llama-linear-rope", "llama-yarn-rope", "qwen2",
            "qwen3", "mistral-window", "gemma3", "gemma2"]
TIED = ("llama-tied", "gemma3")


def _config(kind: str, vocab: int) -> PretrainedConfig:
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.05, tie_word_embeddings=False)
    if kind == "llama-tied":
        return LlamaConfig(**{**common, "tie_word_embeddings": True})
    if kind == "llama3-rope":
        return LlamaConfig(rope_parameters={**LLAMA3_ROPE, "rope_theta": 10000.0}, **common)
    if kind == "llama-linear-rope":
        return LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 10000.0}, **common)
    if kind == "llama-yarn-rope":
        return LlamaConfig(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                            "original_max_position_embeddings": 64}, **common)
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    # Gemma: query_pre_attn_scalar (24) differs from head_dim, so a model scaling by
    # head_dim fails; the window (16) is far shorter than the prompts. Gemma 3's heads are
    # wider than hidden_size / num_heads, as in the real ones (4 x 32 = 128 > 64).
    if kind == "gemma3":
        return Gemma3TextConfig(**{**common, "tie_word_embeddings": True,
                                   "num_hidden_layers": len(GEMMA3_LAYERS)}, head_dim=32,
                                query_pre_attn_scalar=24, sliding_window=WINDOW,
                                layer_types=GEMMA3_LAYERS, rope_parameters=GEMMA3_ROPE)
    if kind == "gemma2":
        # Caps far below the defaults (50, 30), so that they change these tiny scores.
        return Gemma2Config(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                            attn_logit_softcapping=0.5, final_logit_softcapping=2.0, **common)
    assert kind == "mistral-window"
    return MistralConfig(sliding_window=WINDOW, **common)


def _randomise_trivial_weights(model: torch.nn.Module) -> None:
    """Random init leaves biases at 0 and norm weights at 1; make them matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)
            elif "norm" in name:
                param.normal_(mean=1.0, std=0.2)


def _legacy_rope_format(model_dir: Path) -> None:
    """Rewrite config.json as Llama 3.1 and older checkpoints ship it: ``rope_scaling`` and
    a top-level ``rope_theta`` instead of transformers 5's ``rope_parameters``."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    path.write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def family_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Callable[[str], Path]:
    """kind -> a saved tiny checkpoint of that family (built once per module)."""
    built: dict[str, Path] = {}

    def build(kind: str) -> Path:
        if kind not in built:
            built[kind] = save_family(kind, tiny_model_dir, tmp_path_factory.mktemp(kind))
        return built[kind]

    return build


def save_family(kind: str, tiny_model_dir: Path, out: Path) -> Path:
    """A seeded tiny checkpoint of that family, with the tiny model's tokenizer, in out."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(_config(kind, len(tok)))
    _randomise_trivial_weights(model)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    if kind not in TIED:
        assert model.lm_head.weight.data_ptr() != (
            model.get_input_embeddings().weight.data_ptr())
    if kind == "llama3-rope":
        _legacy_rope_format(out)
    return out


def _engine(model_dir: Path, **overrides: object) -> LLMEngine:
    # 20 blocks of 16 = 320 tokens for up to 8 running prompts of up to ~190 tokens:
    # preemption is certain; a 32-token budget chunks every prompt longer than 32.
    config: dict[str, object] = dict(num_kv_blocks=20, block_size=16, max_num_seqs=8,
                                     max_num_batched_tokens=32, max_model_len=512,
                                     max_loras=2, max_lora_rank=8)
    config.update(overrides)
    return LLMEngine.from_model(str(model_dir), **config)


def _run(engine: LLMEngine, items: list[tuple[str, list[int], int, int, str | None]]
         ) -> dict[str, RequestOutput]:
    """items: (request_id, prompt, max_tokens, arrival_step, adapter or None)."""
    pending = sorted(items, key=lambda it: it[3])
    done: dict[str, RequestOutput] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, max_tokens, _, lora = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3),
                lora=lora)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return done


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_matches_transformers(family_dir: Callable[[str], Path], kind: str) -> None:
    """Greedy, teacher-forced fp32 parity under chunked prefill, prefix hits and
    preemption. Prompts (31-190 tokens) and decodes run far past the Mistral and Gemma
    window (16), and past the 64 original positions of the scaled ropes."""
    model_dir = family_dir(kind)
    engine = _engine(model_dir)
    items = shared_prefix_workload(24, seed=21)
    outputs = _run(engine, [(w.request_id, w.prompt, w.max_tokens, w.arrival_step, None)
                            for w in items])
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache.hit_tokens > 0
    assert stats.kv_blocks_used == 0
    ref = load_reference(model_dir)
    for item in items:
        out = outputs[item.request_id]
        assert len(out.token_ids) == item.max_tokens
        check_against_reference(ref, item.prompt, out)


def _make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A rank-8 PEFT adapter on all seven projections, random A and B, made by PEFT."""
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, LoraConfig(
        r=8, lora_alpha=16, target_modules=list(SUPPORTED_MODULES), init_lora_weights=False,
        lora_dropout=0.0))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    peft_model.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen2", "qwen3", "mistral-window", "gemma3",
                                  "gemma2"])
def test_family_adapter_matches_peft(family_dir: Callable[[str], Path], tmp_path: Path,
                                     kind: str) -> None:
    """Adapter and base requests in one chunked batch: each equals PEFT (or the base)."""
    model_dir = family_dir(kind)
    adapter = _make_adapter(model_dir, tmp_path / "ad", seed=31)
    engine = _engine(model_dir, num_kv_blocks=64)
    engine.load_lora("ad", str(adapter))
    rng = random.Random(8)
    items = [(f"q{i}", [rng.randrange(5, 512) for _ in range(rng.randint(20, 70))],
              rng.randint(1, 10), rng.randint(0, 6), "ad" if i % 3 else None)
             for i in range(9)]
    outputs = _run(engine, items)
    assert engine.stats().kv_blocks_used == 0
    peft_model = PeftModel.from_pretrained(load_reference(model_dir), str(adapter)).eval()
    for rid, prompt, _, _, lora in items:
        if lora is None:
            with peft_model.disable_adapter():
                check_against_reference(peft_model, prompt, outputs[rid])
        else:
            check_against_reference(peft_model, prompt, outputs[rid])
    # The adapter really changes the outputs: PEFT's logits differ from the base's.
    ids = torch.tensor([items[1][1]])
    with torch.inference_mode():
        tuned = peft_model(ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(ids).logits
    assert float((tuned - plain).abs().max()) > 0.1


def test_llama3_frequencies_equal_transformers() -> None:
    params: dict[str, Any] = {**LLAMA3_ROPE, "original_max_position_embeddings": 8192,
                              "rope_theta": 500000.0}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=dict(params))
    theirs, scaling = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    base = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    ours = llama3_inv_freq(base, params)
    assert scaling == 1.0
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    cos, sin = rope_cos_sin(config, 16, 32)
    assert cos.shape == sin.shape == (32, 16)


def test_sliding_window_never_plans_cascade_attention() -> None:
    # Cascade attention has no window mask; a windowed model takes the reference path.
    meta = build_attention_metadata([([0, 1, 2], 40)], [([3, 4], 0, 20)], block_size=16,
                                    sliding_window=WINDOW, device=torch.device("cpu"),
                                    cascade=True)
    assert meta.cascade is None and len(meta.decodes) == 1
    assert int((meta.decodes[0].bias == 0).sum()) == WINDOW


def test_layers_with_different_windows_get_their_own_metadata() -> None:
    # Gemma 3: the local layers' metadata masks to the window on the reference path; the
    # global layers' plans cascade attention; one slot mapping serves both.
    metas = build_step_metadata([([0, 1, 2], 40)], [([3, 4], 0, 20)], block_size=16,
                                windows=(WINDOW, None, WINDOW), device=torch.device("cpu"),
                                cascade=True)
    assert list(metas) == [WINDOW, None]
    local, full = metas[WINDOW], metas[None]
    assert local.cascade is None and len(local.decodes) == 1
    assert int((local.decodes[0].bias == 0).sum()) == WINDOW
    assert full.cascade is not None
    assert local.slot_mapping is full.slot_mapping


def test_gemma_shape_reads_layer_types_ropes_and_caps(family_dir: Callable[[str], Path]) -> None:
    gemma3 = ModelShape.from_hf_config(load_hf_config(str(family_dir("gemma3"))))
    assert gemma3.layer_windows == (WINDOW, None, WINDOW)
    assert gemma3.rope_kinds == ("full_attention", "sliding_attention")
    assert gemma3.layer_rope == (1, 0, 1)
    assert gemma3.attn_scale == 24 ** -0.5 and gemma3.qk_norm
    assert gemma3.attn_softcap is None and gemma3.final_softcap is None
    gemma2 = ModelShape.from_hf_config(load_hf_config(str(family_dir("gemma2"))))
    assert gemma2.layer_windows == (WINDOW, None) and gemma2.layer_rope == (0, 0)
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (0.5, 2.0)
    assert not gemma2.qk_norm


@pytest.mark.parametrize(("changes", "match"), [
    (dict(use_bidirectional_attention=True),
     "use_bidirectional_attention=True .* is not supported"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    (dict(rope_parameters={**GEMMA3_ROPE, "sliding_attention": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}),
     r"rope_type 'dynamic' \(sliding_attention layers\) is not supported"),
], ids=["bidirectional", "exact-gelu", "dynamic-local-rope"])
def test_unservable_gemma_configs_are_refused(family_dir: Callable[[str], Path], tmp_path: Path,
                                              changes: dict[str, object], match: str) -> None:
    model_dir = _edited_copy(family_dir("gemma3"), tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=match):
        LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=8))


def _edited_copy(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("changes", "match"), [
    (dict(model_type="gemma", architectures=["GemmaForCausalLM"]),
     r"model type 'gemma' is not supported \(architecture GemmaForCausalLM\)"),
    (dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),
     r"model type 'gemma3' is not supported \(architecture Gemma3ForConditionalGeneration\)"),
    (dict(model_type="mamba9000", architectures=["Mamba9000ForCausalLM"]),
     r"model type 'mamba9000' is not supported \(architecture Mamba9000ForCausalLM\)"),
    (dict(architectures=["LlamaForSequenceClassification"]),
     r"architecture LlamaForSequenceClassification is not supported \(model type 'llama'"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "rope_type 'dynamic' is not supported"),
    (dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], use_sliding_window=True,
          head_dim=16), "qwen3 with use_sliding_window=True is not supported"),
], ids=["gemma1", "gemma3-multimodal", "unknown-type", "classifier-head", "dynamic-rope",
        "qwen3-window"])
def test_unservable_models_are_refused_at_load(tiny_model_dir: Path, tmp_path: Path,
                                               changes: dict[str, object], match: str) -> None:
    model_dir = _edited_copy(tiny_model_dir, tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=match):
        LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=8))
