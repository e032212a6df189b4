"""The offline side: one runner process per engine per repeat, alternating A B A B.

Each job is written to a JSON file, handed to the engine's runner (run_loragate.py under this
interpreter, run_vllm.py under the vLLM venv's), and its result read back; the runner's
output goes to a log next to the job, whose tail is shown if it fails.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.peers.engines import ENGINES, EngineName, PeerEnv, engine_env, runner_command
from benchmarks.peers.job import Job


@dataclass
class OfflineRuns:
    """Every runner result, per engine in run order, and how long each process lived."""

    results: dict[EngineName, list[dict[str, Any]]] = field(
        default_factory=lambda: {e: [] for e in ENGINES})
    process_s: dict[EngineName, list[float]] = field(
        default_factory=lambda: {e: [] for e in ENGINES})


def run_job(engine: EngineName, peer: PeerEnv, job: Job, workdir: Path, tag: str,
            timeout_s: float) -> tuple[dict[str, Any], float]:
    """Run one job in a fresh process of ``engine``; its result and the process's wall time."""
    job_path = workdir / f"{tag}-{engine}.job.json"
    result_path = workdir / f"{tag}-{engine}.result.json"
    log_path = workdir / f"{tag}-{engine}.log"
    job.write(job_path)
    result_path.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log_path, "wb") as log:
        code = subprocess.call(runner_command(engine, peer, job_path, result_path),
                               stdout=log, stderr=subprocess.STDOUT,
                               env=engine_env(engine, job.settings), timeout=timeout_s)
    wall = time.monotonic() - start
    if code != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{engine} runner failed (exit {code}), log {log_path}:\n{tail}")
    return json.loads(result_path.read_text()), wall


def run_alternating(peer: PeerEnv, job: Job, repeats: int, workdir: Path, tag: str,
                    timeout_s: float = 7200.0) -> OfflineRuns:
    """loragate, vLLM, loragate, vLLM, ... ``repeats`` times each."""
    runs = OfflineRuns()
    for repeat in range(repeats):
        for engine in ENGINES:
            print(f"[{tag}] {engine} run {repeat + 1}/{repeats} ...", flush=True)
            result, wall = run_job(engine, peer, job, workdir, f"{tag}-{repeat}", timeout_s)
            runs.results[engine].append(result)
            runs.process_s[engine].append(wall)
            timed = ", ".join(f"{name} {p['seconds']:.1f} s"
                              for name, p in result["phases"].items())
            print(f"[{tag}] {engine} ({result['dtype']}): startup {result['startup_s']:.0f} s, "
                  f"{timed} "
                  f"(process {wall:.0f} s)", flush=True)
    return runs
