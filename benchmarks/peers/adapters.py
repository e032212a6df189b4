"""The multi-LoRA workload's adapters: seeded PEFT directories peer-0 .. peer-N-1 of the
model, rank 8 on q/k/v/o (the issue's shape), written once under MODEL/peer-adapters and
reused by every later run."""

from __future__ import annotations

from pathlib import Path

PEER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PEER_RANK = 8
PEER_SEED = 3000
PEER_B_SCALE = 0.2
"""Shrinks B so the adapted model's outputs stay in a sane range (as bench_adapters does)."""


def peer_adapters_dir(model_dir: str) -> Path:
    return Path(model_dir) / "peer-adapters"


def ensure_peer_adapters(model_dir: str, count: int) -> dict[str, str]:
    """name -> PEFT directory of peer-0 .. peer-<count-1>, writing the missing ones through a
    temporary sibling, so an interrupted run never leaves a half-written adapter behind."""
    from benchmarks.bench_adapters import ensure_adapter

    root = peer_adapters_dir(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str] = {}
    for index in range(count):
        path = root / f"peer-{index}"
        ensure_adapter(model_dir, path, PEER_RANK, PEER_TARGETS, PEER_SEED + index,
                       PEER_B_SCALE)
        paths[path.name] = str(path)
    return paths
