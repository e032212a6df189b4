"""The suite's RESULTS.md block: headline rows from reports, the block replacement that
keeps the hand-written text around it, and the earlier reports kept for benchmarks left out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import benchmarks.__main__ as suite
from benchmarks.suite_report import (
    SUITE_BEGIN,
    SUITE_END,
    Row,
    headline_rows,
    render_block,
    replace_block,
)


def test_headline_rows_read_reports_and_survive_a_broken_one() -> None:
    reports: dict[str, dict[str, Any]] = {
        "lora": {"ratios": {"lora16_over_base": 0.594, "lora16_over_peft": 1.12}},
        "tenancy": {"added": {}}}
    rows = headline_rows(reports)
    assert rows[:2] == [Row("lora", "16 adapters / no adapters (tok/s)", "0.59x", ">= 0.7x"),
                        Row("lora", "16 adapters / PEFT per-adapter batching", "1.12x",
                            ">= 4x")]
    assert rows[2].benchmark == "tenancy" and rows[2].metric.startswith("(report unreadable")


def test_block_replacement_keeps_the_hand_written_text() -> None:
    block = render_block([Row("x", "m", "1.00x", ">= 1x")], [Path("/r/plots/x.png")],
                         {"x": "2026-11-29T12:00"}, False, {"y": "boom\nmore"}, Path("/r"))
    assert block.startswith(SUITE_BEGIN) and block.endswith(SUITE_END)
    assert "| x | m | 1.00x | >= 1x | 2026-11-29T12:00 |" in block
    assert "| y | FAILED: boom | - | - | - |" in block
    assert "![x](plots/x.png)" in block
    text = replace_block("# Results\n\nhand-written\n", block)
    assert text == "# Results\n\nhand-written\n\n" + block + "\n"
    again = replace_block(text + "\nafter\n", block.replace("1.00x", "2.00x"))
    assert again.count(SUITE_BEGIN) == 1 and "2.00x" in again and "1.00x" not in again
    assert again.startswith("# Results\n\nhand-written\n") and again.endswith("\nafter\n")


def test_benchmarks_left_out_keep_their_last_report_of_the_same_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suite, "RESULTS", tmp_path)
    (tmp_path / "lora.json").write_text(json.dumps({"_stamp": "t1", "_quick": False, "x": 1}))
    (tmp_path / "rate.json").write_text(json.dumps({"_stamp": "t2", "_quick": True}))
    (tmp_path / "gateway.json").write_text(json.dumps({"no": "stamp"}))  # not a suite run
    (tmp_path / "tenancy.json").write_text("{broken")
    kept = suite.earlier_reports(list(suite.PARTS), quick=False)
    assert kept == {"lora": {"_stamp": "t1", "_quick": False, "x": 1}}
    assert set(suite.earlier_reports(list(suite.PARTS), quick=True)) == {"rate"}
