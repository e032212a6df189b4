"""The engine on the Triton attention path (interpreted off CUDA) against transformers, with
chunked prefill, prefix-cache hits and preemption; and the backend knob's rules."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.triton_attention import resolve_attention_backend
from tests.parity import WorkItem, check_against_reference, load_reference, run_workload


def _workload() -> list[WorkItem]:
    """Two 40-token documents each read by three requests (the later ones hit the cache),
    distinct questions, few output tokens: every case in a few dozen interpreted steps."""
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(5, 512, (40,), generator=g).tolist() for _ in range(2)]
    items = []
    for i in range(6):
        question = torch.randint(5, 512, (3 + 7 * i,), generator=g).tolist()
        items.append(WorkItem(f"t{i}", docs[i % 2] + question, max_tokens=2 + i % 4,
                              arrival_step=0 if i < 2 else 3 + 2 * i))
    return items


def test_engine_on_triton_attention_matches_transformers(
        kernels: dict[str, ModuleType], tiny_model_dir: Path) -> None:
    # A 32-token budget chunks every prompt; 10 blocks of 8 for requests of 43-83 tokens
    # force preemption; the documents' cached blocks give prefix hits.
    items = _workload()
    engine = LLMEngine.from_model(
        str(tiny_model_dir), attention_backend="triton", num_kv_blocks=14, block_size=8,
        max_num_batched_tokens=32, max_num_seqs=4, max_model_len=512, prefix_caching="on")
    assert engine.runner.triton_block_m is not None
    outputs = run_workload(engine, items)
    stats = engine.stats()
    assert stats.prefix_cache.hit_tokens > 0 and stats.num_preemptions > 0
    ref = load_reference(tiny_model_dir)
    for item in items:
        check_against_reference(ref, item.prompt, outputs[item.request_id])


def test_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"
    assert resolve_attention_backend("torch", cpu) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", cpu)
    with pytest.raises(ValueError, match="attention_backend must be"):
        resolve_attention_backend("flash", cpu)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention_backend must be auto, torch or triton"):
        EngineConfig(model="m", attention_backend="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="load_format must be"):
        EngineConfig(model="m", load_format="pt")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mistral-window", "gemma2", "gemma3"])
def test_windowed_and_capped_families_on_triton_attention(
        kernels: dict[str, ModuleType], tmp_path: Path, tiny_model_dir: Path,
        kind: str) -> None:
    # Sliding windows far shorter than the prompts (Mistral), soft-capped scores and
    # alternating windows (Gemma 2), per-layer windows and ropes (Gemma 3): the kernels'
    # window and cap paths end to end, against transformers.
    from tests.parity import shared_prefix_workload
    from tests.test_model_families import _engine, _run, save_family

    save_family(kind, tiny_model_dir, tmp_path)
    engine = _engine(tmp_path, attention_backend="triton", max_loras=0)
    items = shared_prefix_workload(4, seed=21, num_docs=2)  # 2 documents: prefix hits
    outputs = _run(engine, [(w.request_id, w.prompt, min(w.max_tokens, 4), w.arrival_step,
                             None) for w in items])
    assert engine.stats().prefix_cache.hit_tokens > 0
    ref = load_reference(tmp_path)
    for w in items:
        check_against_reference(ref, w.prompt, outputs[w.request_id])
