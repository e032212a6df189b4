"""Runner for loragate: executes one job (see job.py) with ``engine.llm.LLM``.

    python -m benchmarks.peers.run_loragate JOB.json RESULT.json

Runs under loragate's interpreter, in a process of its own, so its timings are as clean of
the orchestrator as vLLM's are.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from benchmarks.peers.job import Job, phase_result, read_job
from benchmarks.peers.op_profile import profiled


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and every live descendant."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def run(job: Job) -> dict[str, Any]:
    """Build the engine, run every phase, return the result dict (job.py's format)."""
    from importlib.metadata import version

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    s = job.settings
    torch.set_num_threads(s.threads)
    start = time.perf_counter()
    llm = LLM(job.model, dtype=s.dtype, device="cpu", block_size=s.block_size,
              max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
              prefix_caching="on" if s.prefix_caching else "off",
              kv_cache_memory_bytes=s.kv_cache_gib << 30, max_loras=max(1, s.max_loras),
              max_cpu_loras=max(1, s.max_loras, len(job.adapters)),
              max_lora_rank=s.max_lora_rank, seed=s.seed)
    for name, path in job.adapters.items():
        llm.load_lora(name, path)
    result: dict[str, Any] = {"engine": "loragate", "version": version("loragate"),
                              "dtype": str(llm.engine.dtype).removeprefix("torch."),
                              "startup_s": time.perf_counter() - start, "phases": {}}
    for phase in job.phases:
        params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
                  for r in phase.requests]
        with profiled(s.profile_ops and phase.timed) as ops:
            cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
            outputs = llm.generate([list(r.prompt_token_ids) for r in phase.requests], params,
                                   use_tqdm=False, lora=[r.lora for r in phase.requests])
            seconds, cpu = time.perf_counter() - t0, tree_cpu_seconds() - cpu0
        print(f"loragate {phase.name}: {len(phase.requests)} requests in {seconds:.2f} s",
              flush=True)
        if phase.timed:
            result["phases"][phase.name] = phase_result(seconds, cpu, phase.requests,
                                                        [o.token_ids for o in outputs], ops)
    return result


def main(argv: list[str] | None = None) -> None:
    job_path, result_path = argv if argv is not None else sys.argv[1:]
    result = run(read_job(Path(job_path)))
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
