"""The suite's RESULTS.md block: headline rows from reports, the record of every model's
latest figures, the model-column table rendered from it, the block replacement that keeps
the hand-written text around it, and the plots and command lines of the parts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.patches import Rectangle

import benchmarks.__main__ as suite
from benchmarks import suite_record
from benchmarks.suite_plots import PLOTTERS, draw_plots
from benchmarks.suite_record import ModelRecord, PartRecord, Row
from benchmarks.suite_report import (
    SUITE_BEGIN,
    SUITE_END,
    headline_rows,
    render_block,
    replace_block,
)


def _part(rows: list[Row], size: str = "full", stamp: str = "2026-11-29T15:21+00:00",
          commit: str = "abc1234", args: tuple[str, ...] = (), threads: int | None = None,
          note: str = "") -> PartRecord:
    return PartRecord(size, args, threads, stamp, commit, 12.5, tuple(rows), note)


def test_headline_rows_read_reports_and_survive_a_broken_one() -> None:
    reports: dict[str, dict[str, Any]] = {
        "lora": {"ratios": {"lora16_over_base": 0.594, "lora16_over_peft": 1.12}},
        "tenancy": {"added": {}}}
    rows = headline_rows(reports)
    assert rows[:2] == [Row("lora", "16 adapters / no adapters (tok/s)", "0.59x", ">= 0.7x"),
                        Row("lora", "16 adapters / PEFT per-adapter batching", "1.12x",
                            ">= 4x")]
    assert rows[2].benchmark == "tenancy" and rows[2].metric.startswith("(report unreadable")


def test_prefix_rows_leave_out_the_phases_a_size_skipped() -> None:
    summary = {"hit_rate_over_theoretical": 0.998, "ttft_p50_on_over_off": None,
               "throughput_on_over_off": 1.9, "warm_throughput_on_over_off": 2.5,
               "shuffled_hit_rate": None}
    rows = headline_rows({"prefix": {"summary": summary}})
    assert [(r.metric, r.value) for r in rows] == [
        ("hit rate / theoretical reusable fraction", "0.998"),
        ("throughput on / off, cold cache", "1.90x"),
        ("throughput on / off, steady state (warmed cache)", "2.50x")]


PEERS_REPORT: dict[str, Any] = {
    "throughput": [{"workload": "mixed", "ratio": 0.876, "target": 1.0},
                   {"workload": "rag", "ratio": 0.554, "target": 1.2}],
    "serving": {"num_requests": 32, "rows": [
        {"rate": 0.25, "ttft_p50_ratio": 1.18, "target": 1.0},
        {"rate": 1.0, "ttft_p50_ratio": 1.374, "target": 1.0}]},
    "agreement": {"agreement": {"identical": 23, "total": 24},
                  "mixed": {"identical": 128, "total": 128}}}
"""A peers report as ``python -m benchmarks.peers`` writes it, cut to the keys read here."""


def test_peers_rows_are_the_peers_reports_headlines() -> None:
    assert headline_rows({"peers": PEERS_REPORT}) == [
        Row("peers", "mixed throughput loragate / vLLM", "0.88x", ">= 1.0x"),
        Row("peers", "rag throughput loragate / vLLM", "0.55x", ">= 1.2x"),
        Row("peers", "TTFT p50 loragate / vLLM at 0.25 req/s", "1.18x", "<= 1.0x"),
        Row("peers", "TTFT p50 loragate / vLLM at 1 req/s", "1.37x", "<= 1.0x"),
        Row("peers", "greedy agreement with vLLM (identical sequences)", "23/24", "100%")]


def test_peers_plot_draws_each_ratio_beside_parity_and_its_target(tmp_path: Path) -> None:
    figure, ax = plt.subplots()
    PLOTTERS["peers"](PEERS_REPORT, ax)
    assert [bar.get_width() for bar in ax.patches if isinstance(bar, Rectangle)] == [
        0.876, 0.554, 1.18, 1.374]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "mixed throughput (higher better)", "rag throughput (higher better)",
        "TTFT p50 @ 0.25/s (lower better)", "TTFT p50 @ 1/s (lower better)"]
    assert [np.asarray(line.get_xdata()).tolist() for line in ax.get_lines()] == [[1.0, 1.0]]
    targets = np.asarray(ax.collections[0].get_offsets()).tolist()
    assert targets == [[1.0, 0.0], [1.2, 1.0], [1.0, 2.0], [1.0, 3.0]]
    plt.close(figure)
    assert draw_plots({"peers": PEERS_REPORT}, tmp_path) == [tmp_path / "peers.png"]
    assert (tmp_path / "peers.png").stat().st_size > 0
    # An agreement-only run has no ratio to draw: no plot rather than an empty one.
    assert draw_plots({"peers": {"throughput": [], "serving": None,
                                 "agreement": PEERS_REPORT["agreement"]}},
                      tmp_path / "none") == []


def test_models_side_by_side_with_run_lines_sizes_and_plots() -> None:
    demo = ModelRecord("llama, 32M parameters; random weights", {
        "lora": _part([Row("lora", "16 adapters / none", "0.88x", ">= 0.7x")],
                      note="recording commit"),
        "tenancy": _part([Row("tenancy", "p50 added (ms)", "-0.02", "<= 1 ms")])})
    real = ModelRecord("llama, 135M parameters; trained weights", {
        "lora": _part([Row("lora", "16 adapters / none", "0.64x", ">= 0.7x"),
                       Row("lora", "extra", "7", "(report)")], size="medium",
                      stamp="2026-11-30T13:05+00:00", commit="def5678+",
                      args=("--num-requests", "64"), threads=1)})
    plots = {"demo": [Path("/r/plots/demo/lora.png")], "real": []}
    block = render_block({"demo": demo, "real": real}, plots, Path("/r"))
    assert block.startswith(SUITE_BEGIN) and block.endswith(SUITE_END)
    lines = block.splitlines()
    header = lines.index("| benchmark | metric | target | demo | real |")
    assert lines[header + 2:header + 8] == [
        "| lora | *run: date (UTC) · commit · size* | | 2026-11-29 15:21 · abc1234 · full "
        "(recording commit) | 2026-11-30 13:05 · def5678+ · medium, 1 thread |",
        "| lora | 16 adapters / none | >= 0.7x | 0.88x | 0.64x |",
        "| lora | extra | (report) | - | 7 |",
        "| tenancy | *run: date (UTC) · commit · size* | | 2026-11-29 15:21 · abc1234 · full "
        "| - |",
        "| tenancy | p50 added (ms) | <= 1 ms | -0.02 | - |",
        ""]
    assert "- **full**: lora, tenancy their defaults" in lines
    assert "- **medium**: lora `--num-requests 64`" in lines
    assert "- **real**: llama, 135M parameters; trained weights" in lines
    assert "![demo lora](plots/demo/lora.png)" in lines
    assert "Plots, real:" not in lines


def test_block_replacement_keeps_the_hand_written_text() -> None:
    block = render_block({}, {}, Path("/r"))
    text = replace_block("# Results\n\nhand-written\n", block)
    assert text == "# Results\n\nhand-written\n\n" + block + "\n"
    newer = render_block({"m": ModelRecord("d", {"rate": _part([Row("rate", "x", "2", "-")])})},
                         {}, Path("/r"))
    again = replace_block(text + "\nafter\n", newer)
    assert again.count(SUITE_BEGIN) == 1 and "| rate | x | - | 2 |" in again
    assert again.startswith("# Results\n\nhand-written\n") and again.endswith("\nafter\n")


def test_a_run_replaces_only_its_model_and_benchmarks(tmp_path: Path) -> None:
    path = tmp_path / "figures.json"
    assert suite_record.load(path) == {}
    old = _part([Row("lora", "m", "1.00x", "t")])
    models = suite_record.merge({}, "demo", "d", {"lora": old, "rate": old})
    models = suite_record.merge(models, "real", "r", {"lora": old})
    suite_record.save(path, models)
    newer = _part([Row("lora", "m", "2.00x", "t")], size="medium", threads=1,
                  args=("--num-requests", "8"))
    merged = suite_record.merge(suite_record.load(path), "demo", "d2", {"lora": newer})
    assert list(merged) == ["demo", "real"]
    assert merged["demo"].parts == {"lora": newer, "rate": old}
    assert merged["demo"].description == "d2"
    assert merged["real"].parts == {"lora": old}
    suite_record.save(path, merged)
    assert suite_record.load(path) == merged


def test_labels_name_the_demo_shapes_and_other_models_by_directory(tmp_path: Path) -> None:
    from dataclasses import asdict

    from engine.demo_shapes import WIDE_SPEC, DemoModelSpec

    for name, spec in (("demo", DemoModelSpec()), ("wide", WIDE_SPEC)):
        model = tmp_path / f"some-{name}"
        model.mkdir()
        (model / "loragate_demo.json").write_text(repr(asdict(spec)) + "\n")
        assert suite_record.default_label(str(model)) == name
    other = tmp_path / "SmolLM2-135M-Instruct"
    other.mkdir()
    assert suite_record.default_label(str(other)) == "SmolLM2-135M-Instruct"


def test_sizes_pick_parts_and_quick_runs_record_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suite, "RESULTS", tmp_path / "results")
    figures = tmp_path / "figures.json"
    calls: list[str] = []

    def fake_run(part: suite.Part, args: Any, out_dir: Path, log_dir: Path) -> dict[str, Any]:
        calls.append(part.name)
        raise RuntimeError("not run in this test")

    monkeypatch.setattr(suite, "run_part", fake_run)
    args = ["--model", str(tmp_path), "--label", "m", "--figures", str(figures),
            "--results-md", str(tmp_path / "RESULTS.md")]
    assert suite.main([*args, "--size", "medium"]) == 1
    assert calls == ["throughput", "prefix", "lora", "gateway", "peers"]
    calls.clear()
    assert suite.main([*args, "--quick", "--only", "rate"]) == 1
    assert calls == ["rate"] and not figures.exists()
    with pytest.raises(SystemExit):
        suite.main([*args, "--size", "medium", "--only", "rate"])


def test_the_suite_threads_reach_peers_as_its_flag_and_others_by_environment(
        tmp_path: Path) -> None:
    parts = {p.name: p for p in suite.PARTS}
    out = tmp_path / "r.json"

    def command(name: str, size: str, threads: int) -> list[str]:
        args = argparse.Namespace(model="M", size=size, threads=threads)
        return suite.part_command(parts[name], args, out)[1:]

    assert command("peers", "medium", 1) == [
        "-m", "benchmarks.peers", "--model", "M", "--out", str(out), "--repeats", "1",
        "--parts", "agreement,mixed,rag,lora", "--threads", "1"]
    # 0 = torch's choice: peers keeps its own default (the comparison's 2 threads).
    assert command("peers", "quick", 0) == [
        "-m", "benchmarks.peers", "--model", "M", "--out", str(out), "--quick"]
    assert command("rate", "full", 1) == [
        "-m", "benchmarks.rate_sweep", "--model", "M", "--out", str(out)]


def test_every_peers_size_parses_with_the_suites_flags() -> None:
    from benchmarks.peers.__main__ import parse_args

    peers = next(p for p in suite.PARTS if p.name == "peers")
    for size, extra in peers.sizes.items():
        args = parse_args(["--model", "M", "--out", "r.json", *extra, "--threads", "1"])
        assert args.threads == 1 and str(args.out) == "r.json", size
    medium = parse_args(["--model", "M", *peers.sizes["medium"]])
    assert medium.repeats == 1 and "serving" not in medium.parts


def test_the_record_file_in_the_repository_loads_and_renders() -> None:
    models = suite_record.load(suite.FIGURES)
    assert "demo" in models
    block = render_block(models, suite.plots_by_label(models), suite.HERE)
    for paths in suite.plots_by_label(models).values():
        assert all(p.exists() for p in paths)
    assert json.loads(suite.FIGURES.read_text())["models"]
    assert block.count("*run: date (UTC) · commit · size*") == len(
        {name for m in models.values() for name in m.parts})
