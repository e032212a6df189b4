"""The peer benchmark's report math: ratios, agreement, serving rows, the printed table, and
the runner result format the loragate runner writes (on the tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.peers.job import EngineSettings, Job, Phase
from benchmarks.peers.report import (
    ServingRow,
    ThroughputFigures,
    compare_outputs,
    headlines,
    pooled_latency,
    table,
    throughput_figures,
)
from benchmarks.peers.run_loragate import run
from benchmarks.peers.workloads import PeerRequest


def _result(seconds: float, outputs: list[list[int]]) -> dict[str, object]:
    return {"phases": {"mixed": {"seconds": seconds, "cpu_seconds": 0.0, "prompt_tokens": 30,
                                 "output_tokens": sum(map(len, outputs)),
                                 "output_token_ids": outputs}}}


def test_throughput_ratio_is_vllm_seconds_over_loragate_seconds() -> None:
    outputs = [[1, 2], [3, 4, 5]]
    figures = throughput_figures("mixed", [_result(10.0, outputs), _result(14.0, outputs)],
                                 [_result(6.0, outputs), _result(6.0, outputs)])
    assert figures.loragate_median_s == 12.0 and figures.vllm_median_s == 6.0
    assert figures.ratio == 0.5
    body = figures.to_json()
    assert body["loragate"]["output_tokens_per_s"] == 5 / 12.0
    assert body["vllm"]["total_tokens_per_s"] == 35 / 6.0 and body["target"] == 1.0
    with pytest.raises(ValueError):
        ThroughputFigures("mixed", (), (1.0,), 1, 1, 1)


def test_compare_outputs_counts_identical_sequences_and_first_divergence() -> None:
    agreement = compare_outputs([[1, 2, 3], [1, 2, 3], [4, 5], [6]],
                                [[1, 2, 3], [1, 9, 3], [4, 5, 6], [6]])
    assert (agreement.identical, agreement.total) == (2, 4)
    assert agreement.first_divergence == (1, 2) and agreement.share == 0.5
    with pytest.raises(ValueError):
        compare_outputs([[1]], [])


def test_serving_rows_pool_repeats_and_table_prints_every_figure() -> None:
    ours = pooled_latency([{"ttft_p50_ms": 100.0, "ttft_p99_ms": 300.0, "itl_p50_ms": 20.0,
                            "itl_p99_ms": 40.0},
                           {"ttft_p50_ms": 200.0, "ttft_p99_ms": 500.0, "itl_p50_ms": 30.0,
                            "itl_p99_ms": 60.0}])
    assert ours["ttft_p50_ms"] == 150.0
    theirs = {"ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0, "itl_p50_ms": 25.0,
              "itl_p99_ms": 50.0}
    row = ServingRow(0.5, ours, theirs)
    assert row.ttft_p50_ratio == 1.5 and row.to_json()["target"] == 1.0
    figures = ThroughputFigures("rag", (10.0,), (12.0,), 4, 100, 20)
    text = table([figures], {"agreement": compare_outputs([[1]], [[1]])}, [row])
    assert "1.20x" in text and ">= 1.2x" in text
    assert "serve 0.5/s ttft_p50_ms" in text and "1.50x" in text
    assert "1/1 identical" in text


def test_loragate_runner_writes_the_result_contract(tiny_model_dir: Path,
                                                    tiny_adapters: dict[str, Path]) -> None:
    prompts = [PeerRequest(tuple(range(10, 30)), 5), PeerRequest(tuple(range(40, 52)), 3, "a0")]
    job = Job(str(tiny_model_dir), EngineSettings(threads=1, max_loras=1, kv_cache_gib=1),
              (Phase("warmup", (PeerRequest((7, 8, 9), 2),), timed=False),
               Phase("mixed", tuple(prompts))), {"a0": str(tiny_adapters["a0"])})
    result = run(job)
    assert result["engine"] == "loragate" and set(result["phases"]) == {"mixed"}
    assert result["dtype"] == "float32"  # EngineSettings.dtype
    phase = result["phases"]["mixed"]
    assert [len(ids) for ids in phase["output_token_ids"]] == [5, 3]
    assert phase["prompt_tokens"] == 32 and phase["output_tokens"] == 8
    assert phase["seconds"] > 0 and result["startup_s"] > 0


def test_headlines_read_a_written_report() -> None:
    report = {"throughput": [ThroughputFigures("rag", (10.0,), (12.0,), 4, 100, 20).to_json()],
              "serving": {"rows": [ServingRow(0.5, {"ttft_p50_ms": 50.0},
                                              {"ttft_p50_ms": 100.0}).to_json()]},
              "agreement": {"agreement": compare_outputs([[1], [2]], [[1], [3]]).to_json()}}
    assert headlines(report) == [
        ("rag throughput loragate / vLLM", "1.20x", ">= 1.2x"),
        ("TTFT p50 loragate / vLLM at 0.5 req/s", "0.50x", "<= 1.0x"),
        ("greedy agreement with vLLM (identical sequences)", "1/2", "100%")]
    assert headlines({}) == []


def test_profiled_ops_sum_into_kinds_beside_the_time_no_op_covered() -> None:
    import torch

    from benchmarks.peers.op_profile import by_kind, kind_of, profiled

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with profiled(True) as ops:
        for _ in range(3):
            torch.nn.functional.scaled_dot_product_attention(a[None], b[None], b[None])
            torch.mm(a, b).relu_()
    assert any(kind_of(op) == "attention" for op in ops)
    assert any(kind_of(op) == "gemm" for op in ops)
    kinds = by_kind(ops, wall_s=10.0)
    assert kinds["outside ops"] == 10.0 - sum(ops.values()) > 0
    with profiled(False) as nothing:
        torch.mm(a, b)
    assert nothing == {}
    assert kind_of("mkldnn::_linear_pointwise") == "gemm"
    assert kind_of("loragate::paged_decode_attention") == "attention"
    assert kind_of("_C::cpu_attention_with_kv_cache") == "attention"
