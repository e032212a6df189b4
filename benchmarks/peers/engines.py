"""How each engine is started: runner and server command lines and their environments.

vLLM runs from its own venv (benchmarks/peers/setup_venv.py), with the environment its CPU
build needs on this machine: ``VLLM_CPU_OMP_THREADS_BIND`` pins its worker to ``threads``
cores (its default on 2 cores is 1 thread + 1 core reserved), ``VLLM_CPU_KVCACHE_SPACE``
sizes its KV cache, ``VLLM_USE_AOT_COMPILE=0`` because reloading 0.32.0's AOT cache fails
(it compiles with inductor at every start instead). loragate gets ``OMP_NUM_THREADS`` and
its runner sets torch's thread count to the same number.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from benchmarks.peers.job import EngineSettings

EngineName = Literal["loragate", "vllm"]
ENGINES: tuple[EngineName, ...] = ("loragate", "vllm")
REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class PeerEnv:
    """Where the two interpreters are."""

    vllm_venv: Path
    loragate_python: str = sys.executable

    @property
    def vllm_python(self) -> Path:
        return self.vllm_venv / "bin" / "python"


def base_env(settings: EngineSettings) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(settings.threads), "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    if settings.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = settings.omp_wait_policy.upper()
    return env


def engine_env(engine: EngineName, settings: EngineSettings) -> dict[str, str]:
    """The environment of a runner or server of ``engine``."""
    env = base_env(settings)
    if engine == "loragate":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT),
                                                        env.get("PYTHONPATH", "")) if p)
        return env
    env.pop("PYTHONPATH", None)  # the vLLM venv must not see loragate's packages
    env.update({"VLLM_CPU_OMP_THREADS_BIND": f"0-{settings.threads - 1}",
                "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib),
                "VLLM_USE_AOT_COMPILE": "0", "VLLM_NO_USAGE_STATS": "1",
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING")})
    if settings.profile_ops:  # the engine core in the runner's process, where the profiler is
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def runner_command(engine: EngineName, peer: PeerEnv, job: Path, result: Path) -> list[str]:
    if engine == "loragate":
        return [peer.loragate_python, "-m", "benchmarks.peers.run_loragate", str(job),
                str(result)]
    return [str(peer.vllm_python), str(HERE / "run_vllm.py"), str(job), str(result)]


def serve_command(engine: EngineName, peer: PeerEnv, model: str, settings: EngineSettings,
                  port: int) -> list[str]:
    """`loragate serve` or vLLM's OpenAI server on 127.0.0.1:port with the comparison settings."""
    common = {"--dtype": settings.dtype, "--block-size": str(settings.block_size),
              "--max-num-seqs": str(settings.max_num_seqs),
              "--max-num-batched-tokens": str(settings.max_num_batched_tokens),
              "--seed": str(settings.seed), "--port": str(port), "--host": "127.0.0.1"}
    flags = [item for pair in common.items() for item in pair]
    if engine == "loragate":
        return [peer.loragate_python, "-m", "gateway.cli", "serve", "--model", model,
                "--state-path", "", "--device", "cpu", "--prefix-caching",
                "on" if settings.prefix_caching else "off", *flags]
    caching = "--enable-prefix-caching" if settings.prefix_caching else "--no-enable-prefix-caching"
    # The module entry point takes `vllm serve`'s flags; the `vllm` script itself looks up the
    # distribution "vllm", which vllm-cpu is not, and exits before parsing anything.
    eager = ["--enforce-eager"] if settings.vllm_eager else []
    return [str(peer.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            caching, *eager, *flags]
