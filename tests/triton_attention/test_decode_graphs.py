"""Decode-only steps on the persistent buffers of engine/decode_graphs.py: uncaptured on a
CPU (Triton's interpreter), captured as CUDA graphs on a GPU; against the eager path."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from engine.decode_graphs import graph_batch_sizes
from engine.llm_engine import LLMEngine
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from lora.ops import BACKEND_ENV
from tests.parity import check_against_reference, load_reference

HAS_CUDA = torch.cuda.is_available()


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]


def _run(model_dir: Path, adapters: dict[str, Path], device: str, **knobs: object
         ) -> tuple[LLMEngine, dict[str, RequestOutput]]:
    """Seven requests, three of them on adapters (the longest on none), greedy, each one
    token longer than the one before: decode steps of 1 to 7 rows with and without adapter
    rows, so the buckets pad and the LoRA segments change from step to step."""
    knobs = {"max_loras": 2, "max_lora_rank": 8, **knobs}
    engine = LLMEngine.from_model(str(model_dir), device=device, block_size=8,
                                  num_kv_blocks=64, max_num_seqs=7, max_num_batched_tokens=64,
                                  **knobs)
    for name, path in adapters.items():
        engine.load_lora(name, str(path))
    g = torch.Generator().manual_seed(3)
    lora_of = ([None, "a0", None, "a1", None, "a0", None] if adapters
               else [None] * 7)
    for i, lora in enumerate(lora_of):
        prompt = torch.randint(5, 512, (4 + 5 * i,), generator=g).tolist()
        engine.add_request(f"g{i}", prompt, SamplingParams(
            max_tokens=2 + i, temperature=0.0, ignore_eos=True, logprobs=3), lora=lora)
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return engine, outputs


def _same(a: dict[str, RequestOutput], b: dict[str, RequestOutput], atol: float) -> None:
    assert a.keys() == b.keys()
    for rid, out in a.items():
        assert out.token_ids == b[rid].token_ids, rid
        other = b[rid].logprobs
        assert out.logprobs is not None and other is not None
        for mine, theirs in zip(out.logprobs, other, strict=True):
            for tid, lp in mine.items():
                assert abs(lp - theirs[tid]) <= atol, (rid, tid, lp, theirs[tid])


def test_static_decode_path_matches_eager_with_adapters(
        kernels: dict[str, ModuleType], tiny_model_dir: Path, tiny_adapters: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    device = "cuda" if HAS_CUDA else "cpu"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    graphed, on = _run(tiny_model_dir, tiny_adapters, device, attention_backend="triton")
    assert graphed.runner.decode_graphs is not None and graphed.runner.graph_lora
    used = set(graphed.runner.decode_graphs._graphs)
    # Steps of several sizes with adapter rows; the last request alone, without.
    assert (1, False) in used and len({size for size, lora in used if lora}) >= 3, used
    _, off = _run(tiny_model_dir, tiny_adapters, device, attention_backend="triton",
                  cuda_graphs=False)
    _same(on, off, 1e-5)
    monkeypatch.setenv(BACKEND_ENV, "torch")
    _, reference = _run(tiny_model_dir, tiny_adapters, device, attention_backend="torch")
    _same(on, reference, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_captured_graphs_match_transformers(kernels: dict[str, ModuleType],
                                            tiny_model_dir: Path) -> None:
    engine, outputs = _run(tiny_model_dir, {}, "cuda", dtype="float32", max_loras=0)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.capture
    assert all(entry.graph is not None for entry in graphs._graphs.values())
    ref = load_reference(tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    for i in range(7):
        prompt = torch.randint(5, 512, (4 + 5 * i,), generator=g).tolist()
        check_against_reference(ref, prompt, outputs[f"g{i}"])
