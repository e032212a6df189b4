"""The benchmarks' adapters: seeded PEFT directories bench-0, bench-1, ... of the demo model
(ranks alternating 8 and 16, all seven projections, b_scale=0.2), written once under
DIR/bench-adapters and reused by every benchmark that needs adapters."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from engine.demo_model import make_peft_adapter
from lora.adapter import SUPPORTED_MODULES

ADAPTER_SEED = 2000
ADAPTER_B_SCALE = 0.2


def adapter_name(index: int) -> str:
    return f"bench-{index}"


def adapter_rank(index: int) -> int:
    return 8 if index % 2 == 0 else 16


def ensure_adapter(model_dir: str, path: Path, rank: int, target_modules: Sequence[str],
                   seed: int, b_scale: float) -> None:
    """Write a random PEFT adapter at ``path`` unless a whole one is there. It is written to a
    temporary sibling and renamed, so an interrupted run never leaves a half-written adapter
    that a later run would reuse."""
    if (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file():
        return
    print(f"  writing adapter {path.name} (rank {rank}, {', '.join(target_modules)})",
          flush=True)
    tmp = path.parent / f".{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    make_peft_adapter(model_dir, tmp, rank=rank, target_modules=tuple(target_modules),
                      seed=seed, b_scale=b_scale)
    tmp.rename(path)


def ensure_adapters(model_dir: str, adapters_dir: Path, count: int) -> dict[str, Path]:
    """name -> PEFT directory of bench-0 .. bench-<count-1>, writing the missing ones."""
    paths: dict[str, Path] = {}
    for index in range(count):
        name = adapter_name(index)
        ensure_adapter(model_dir, adapters_dir / name, adapter_rank(index), SUPPORTED_MODULES,
                       ADAPTER_SEED + index, ADAPTER_B_SCALE)
        paths[name] = adapters_dir / name
    return paths


def bench_adapters_dir(model_dir: str) -> Path:
    return Path(model_dir) / "bench-adapters"
