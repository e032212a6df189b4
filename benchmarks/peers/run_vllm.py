"""Runner for vLLM: executes one job (see job.py) with ``vllm.LLM`` and writes its result.

    PEERVENV/bin/python benchmarks/peers/run_vllm.py JOB.json RESULT.json

Runs under the vLLM venv's interpreter, so it imports only the standard library, psutil,
vLLM and op_profile.py beside it. The environment (thread binding, KV cache space, compile
switches) comes from the orchestrator; see benchmarks/peers/engines.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import psutil

# op_profile (standard library only) beside this script; loragate's packages stay out of sight.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from op_profile import profiled


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


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    settings = job["settings"]
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora_kwargs: dict[str, Any] = {}
    if settings["max_loras"]:
        lora_kwargs = {"enable_lora": True, "max_loras": settings["max_loras"],
                       "max_lora_rank": settings["max_lora_rank"],
                       "max_cpu_loras": max(settings["max_loras"], len(job["adapters"]))}
    llm = LLM(model=job["model"], dtype=settings["dtype"],
              block_size=settings["block_size"],
              max_num_seqs=settings["max_num_seqs"],
              max_num_batched_tokens=settings["max_num_batched_tokens"],
              enable_prefix_caching=settings["prefix_caching"], seed=settings["seed"],
              enforce_eager=settings["vllm_eager"], **lora_kwargs)
    startup = time.perf_counter() - t0
    lora_ids = {name: i + 1 for i, name in enumerate(sorted(job["adapters"]))}
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    result: dict[str, Any] = {"engine": "vllm", "version": vllm.__version__, "dtype": dtype,
                              "startup_s": startup, "phases": {}}
    for phase in job["phases"]:
        requests = phase["requests"]
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
        params = [SamplingParams(max_tokens=r["output_len"], temperature=0.0, ignore_eos=True)
                  for r in requests]
        loras = [LoRARequest(r["lora"], lora_ids[r["lora"]], job["adapters"][r["lora"]])
                 if r["lora"] else None for r in requests]
        with profiled(settings.get("profile_ops", False) and phase["timed"]) as ops:
            cpu0, start = tree_cpu_seconds(), time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False,
                                   lora_request=loras if settings["max_loras"] else None)
            seconds, cpu = time.perf_counter() - start, tree_cpu_seconds() - cpu0
        print(f"vllm {phase['name']}: {len(requests)} requests in {seconds:.2f} s", flush=True)
        if phase["timed"]:
            ids = [list(o.outputs[0].token_ids) for o in outputs]
            result["phases"][phase["name"]] = {
                "seconds": seconds, "cpu_seconds": cpu,
                "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
                "output_tokens": sum(len(i) for i in ids), "output_token_ids": ids,
                **({"ops": ops} if ops else {})}
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
