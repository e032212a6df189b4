"""The suite's RESULTS.md block: headline rows from reports, the record of every model's
latest figures, the model-column table rendered from it, and the block replacement that keeps
the hand-written text around it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import benchmarks.__main__ as suite
from benchmarks import suite_record
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

    from engine.demo_model import WIDE_SPEC, DemoModelSpec

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
    assert calls == ["throughput", "prefix", "lora", "gateway"]
    calls.clear()
    assert suite.main([*args, "--quick", "--only", "rate"]) == 1
    assert calls == ["rate"] and not figures.exists()
    with pytest.raises(SystemExit):
        suite.main([*args, "--size", "medium", "--only", "rate"])


def test_the_record_file_in_the_repository_loads_and_renders() -> None:
    models = suite_record.load(suite.FIGURES)
    assert "demo" in models
    block = render_block(models, suite.plots_by_label(models), suite.HERE)
    for paths in suite.plots_by_label(models).values():
        assert all(p.exists() for p in paths)
    assert json.loads(suite.FIGURES.read_text())["models"]
    assert block.count("*run: date (UTC) · commit · size*") == len(
        {name for m in models.values() for name in m.parts})
