"""dtype="auto" on a CPU: bfloat16 where the CPU has AMX tile units, float32 elsewhere; an
engine on it keeps weights, KV cache and LoRA slots in that dtype and samples from float32
logits. (The rest of the suite pins "auto" to float32, tests/conftest.py, so that it compares
with float32 references on every host; these tests take the rule back.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import PretrainedConfig

import engine.models.loader as loader
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from lora.layers import LoraLinear

THE_RULE = loader.cpu_auto_dtype  # bound before the suite's pin replaces it


@pytest.fixture
def amx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the CPU has AMX, as the test asks: the rule restored and the probe faked."""
    has: bool = request.param
    monkeypatch.setattr(loader, "cpu_auto_dtype", THE_RULE)
    monkeypatch.setattr(loader, "native_bf16", lambda: has)
    return has


@pytest.mark.parametrize("amx", [True, False], indirect=True, ids=["amx", "no-amx"])
def test_auto_on_a_cpu_is_bfloat16_only_with_amx(amx: bool) -> None:
    config = PretrainedConfig.from_dict({"torch_dtype": "float16"})
    cpu = torch.device("cpu")
    want = torch.bfloat16 if amx else torch.float32
    assert loader.resolve_dtype("auto", config, cpu) == want  # whatever the checkpoint says
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                        ("float16", torch.float16)):
        assert loader.resolve_dtype(name, config, cpu) == dtype  # a named dtype wins


@pytest.mark.parametrize("amx", [True], indirect=True, ids=["amx"])
def test_an_auto_engine_with_amx_runs_bfloat16_and_samples_float32(
        amx: bool, tiny_model_dir: Path, tiny_adapters: dict[str, Path],
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        engine = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=32, max_loras=2,
                                      max_num_batched_tokens=64)
    # The choice is said where it is made, with what it changes.
    assert "--dtype float32 for reference parity" in caplog.text
    runner = engine.runner
    assert engine.dtype == torch.bfloat16
    assert runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in runner.kv_caches)
    slots = [m for m in runner.model.modules() if isinstance(m, LoraLinear)]
    assert slots and all(m.lora_a is not None and m.lora_a.dtype == torch.bfloat16
                         and m.lora_b is not None and m.lora_b.dtype == torch.bfloat16
                         for m in slots)
    engine.load_lora("a1", str(tiny_adapters["a1"]))
    logits = runner.model.compute_logits(torch.zeros(2, runner.model.shape.hidden_size,
                                                     dtype=torch.bfloat16))
    assert logits.dtype == torch.float32
    for lora in (None, "a1"):
        engine.add_request(f"r-{lora}", list(range(5, 45)),
                           SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                          logprobs=2), lora=lora)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert [len(o.token_ids) for o in finished.values()] == [6, 6]

