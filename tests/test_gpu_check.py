"""benchmarks/gpu_check.py end to end in its dry-run mode (tiny shapes, CPU, Triton's
interpreter), so the script a GPU run depends on cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_section(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path), "--dry-run"],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["errors"] == {}
    assert all(r["returncode"] == 0 for r in record["gpu_tests"].values())
    assert len(record["decode_attention"]) == 2 and len(record["sgmv"]) == 2
    checks = record["engine_checks"]
    assert checks["attention_backend"] == "triton"
    for key in ("engine", "engine_16_adapters", "transformers_static",
                "engine_peft_workload", "peft_per_adapter"):
        assert checks[key]["output_tok_per_s"] > 0
    assert [len(runs) for runs in checks["runs"].values()] == [2, 2]
    assert checks["decode_step"]["sample_ms"] > 0
    assert checks["decode_step"]["step_ms"] >= checks["decode_step"]["forward_ms"] > 0
    summary = (tmp_path / "summary.txt").read_text()
    assert "decode attention" in summary and "engine_over_transformers" in summary
    assert "adapters_over_peft" in summary
