"""LORAGATE_* environment variables that nothing reads are named at start, with the closest
known name: a typo in a setting must not pass without a word."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.config import EngineConfig
from engine.env_names import OTHER_NAMES, field_names, unknown_names
from gateway.config import GatewayConfig
from gateway.serve import free_port

ROOT = Path(__file__).resolve().parent.parent
NOT_VARIABLES = {"LORAGATE_VEC_WIDTH",  # a C++ macro (engine/cpu_kernels/vec_math.h)
                 "LORAGATE_FIELD_NAME"}  # the pattern's placeholder in docs
"""Names the repository writes that are not environment variables."""
TYPO = "LORAGATE_MAX_LORA"


def test_every_name_the_repository_mentions_is_known() -> None:
    # The registry stays complete: a new LORAGATE_* variable read anywhere (code, docs,
    # manifests, dev.sh) is either a config field's or listed in engine/env_names.py.
    found = subprocess.run(
        ["git", "grep", "-ohE", r"LORAGATE_[A-Z][A-Z0-9_]*", "--", ".",
         ":!tests/test_env_names.py"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    known = field_names(EngineConfig, GatewayConfig) | OTHER_NAMES | NOT_VARIABLES
    assert {"LORAGATE_HOME", "LORAGATE_MAX_LORAS"} <= set(found)  # the scan sees them
    assert sorted(set(found) - known) == []


def test_unknown_names_come_with_the_closest_known_one() -> None:
    environ = {TYPO: "8", "LORAGATE_MAX_LORAS": "8", "LORAGATE_HOME": "/x",
               "LORAGATE_ZZZZZZ": "1", "OTHER": "1"}
    assert unknown_names(field_names(EngineConfig), environ) == [
        (TYPO, "LORAGATE_MAX_LORAS"), ("LORAGATE_ZZZZZZ", None)]


def test_serve_warns_about_a_misspelt_setting(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A gateway attached to an engine that is not there: enough to reach the check.
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {**os.environ, TYPO: "8", "LORAGATE_ROUTING": "round_robin"}
    with open(log_path, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_model_dir),
             "--engine", "http://127.0.0.1:9", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    try:  # up once /health answers at all (503: its engine is not there)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
                break
            time.sleep(0.2)
    finally:
        process.terminate()
        process.wait(30)
    log = log_path.read_text()
    assert re.search(rf"ignoring the environment variable {TYPO}: loragate serve reads no "
                     rf"such setting \(did you mean LORAGATE_MAX_LORAS\?\)", log), log
    assert "LORAGATE_ROUTING" not in log  # a gateway setting is read
