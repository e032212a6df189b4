"""The JSON contract between the orchestrator and the two runner scripts.

A job file::

    {"model": DIR, "settings": {EngineSettings fields}, "adapters": {name: PEFT dir},
     "phases": [{"name": str, "timed": bool, "requests": [PeerRequest.to_json(), ...]}]}

A runner builds one engine from ``settings``, runs the phases in order through its engine's
offline API (all of a phase's requests in one generate call, greedy, ignore_eos, exactly
``output_len`` tokens each) and writes::

    {"engine": "loragate" | "vllm", "version": str, "dtype": str (the one it runs in),
     "startup_s": float,
     "phases": {name: {"seconds": float, "cpu_seconds": float, "prompt_tokens": int,
                       "output_tokens": int, "output_token_ids": [[int, ...], ...],
                       "ops": {op name: self seconds} (with settings.profile_ops)}}}

``seconds`` is the wall time of that generate call inside the runner's process,
``cpu_seconds`` the CPU time its whole process tree spent over the same call (vLLM's offline
LLM runs its engine core in a child process). Untimed phases (warm-ups) are run and left out
of the result.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.peers.workloads import PeerRequest


@dataclass(frozen=True)
class EngineSettings:
    """What both engines are configured with (the issue's comparison settings by default)."""

    threads: int = 2
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 32
    prefix_caching: bool = False
    max_loras: int = 0
    """0 = LoRA off."""
    max_lora_rank: int = 8
    kv_cache_gib: int = 4
    seed: int = 0
    dtype: str = "float32"
    """Weights, activations and KV cache of both engines: float32 (greedy outputs agree
    token for token) or bfloat16 (vLLM's CPU default for any checkpoint, and loragate's
    "auto" on a CPU with AMX; outputs then differ after a few tokens between two engines'
    orders of summation) or auto (each engine picks its own, as a user starting it with its
    defaults gets: vLLM bfloat16 on any x86 CPU, loragate bfloat16 only where AMX makes it
    the faster dtype)."""
    omp_wait_policy: str = ""
    """OMP_WAIT_POLICY for both engines ("" = the OpenMP runtime's default, which spins).
    On a host busier than its cores, spinning threads wait on descheduled siblings: loragate
    with 2 threads ran a 4 x 16-token batch in 40-80 s there, and in 4.3 s with "PASSIVE"."""
    vllm_eager: bool = False
    """vLLM without torch.compile (enforce_eager): skips its inductor compile at start (3-5
    minutes per process on a busy 2-core host), at the cost of its compiled speed. --quick
    uses it; the full benchmark does not."""
    profile_ops: bool = False
    """Runner side: torch's profiler over the timed phases, each phase's op times added to
    the result (benchmarks/peers/op_profile.py); vLLM then runs in the runner's process."""

    def __post_init__(self) -> None:
        for name in ("threads", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "max_lora_rank", "kv_cache_gib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.omp_wait_policy.upper() not in ("", "ACTIVE", "PASSIVE"):
            raise ValueError(f"omp_wait_policy must be ACTIVE or PASSIVE, got "
                             f"{self.omp_wait_policy!r}")
        if self.dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16 or auto, got {self.dtype!r}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")


@dataclass(frozen=True)
class Phase:
    """One generate call: a name, whether it is timed, its requests."""

    name: str
    requests: tuple[PeerRequest, ...]
    timed: bool = True


@dataclass(frozen=True)
class Job:
    """Everything one runner process does."""

    model: str
    settings: EngineSettings
    phases: tuple[Phase, ...]
    adapters: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "settings": asdict(self.settings),
                "adapters": dict(self.adapters),
                "phases": [{"name": p.name, "timed": p.timed,
                            "requests": [r.to_json() for r in p.requests]}
                           for p in self.phases]}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json()))


def read_job(path: Path) -> Job:
    """The job a runner was handed (the loragate runner's side of the contract)."""
    raw = json.loads(path.read_text())
    phases = tuple(Phase(p["name"], tuple(PeerRequest(tuple(r["prompt_token_ids"]),
                                                      int(r["output_len"]), r["lora"])
                                          for r in p["requests"]), bool(p["timed"]))
                   for p in raw["phases"])
    return Job(raw["model"], EngineSettings(**raw["settings"]), phases, dict(raw["adapters"]))


def phase_result(seconds: float, cpu_seconds: float, requests: Sequence[PeerRequest],
                 outputs: Sequence[Sequence[int]], ops: dict[str, float] | None = None
                 ) -> dict[str, Any]:
    """One timed phase's entry in a runner's result (``ops``: profiled op times, if any)."""
    return {"seconds": seconds, "cpu_seconds": cpu_seconds,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "output_tokens": sum(len(o) for o in outputs),
            "output_token_ids": [list(o) for o in outputs], **({"ops": ops} if ops else {})}
