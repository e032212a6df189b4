"""The benchmarks' adapters: seeded PEFT directories bench-0, bench-1, ... of the demo model
(ranks alternating 8 and 16, all seven projections, b_scale=0.2), written once under
DIR/bench-adapters and reused by every benchmark that needs adapters."""

from __future__ import annotations

import shutil
from pathlib import Path

from engine.demo_model import make_peft_adapter
from lora.adapter import SUPPORTED_MODULES

ADAPTER_SEED = 2000
ADAPTER_B_SCALE = 0.2


def adapter_name(index: int) -> str:
    return f"bench-{index}"


def adapter_rank(index: int) -> int:
    return 8 if index % 2 == 0 else 16


def ensure_adapters(model_dir: str, adapters_dir: Path, count: int) -> dict[str, Path]:
    """name -> PEFT directory of bench-0 .. bench-<count-1>, writing the missing ones.

    Each is written to a temporary sibling and renamed, so an interrupted run never leaves a
    half-written adapter that a later run would reuse."""
    paths: dict[str, Path] = {}
    for index in range(count):
        name = adapter_name(index)
        path = adapters_dir / name
        if not ((path / "adapter_config.json").is_file()
                and (path / "adapter_model.safetensors").is_file()):
            print(f"  writing adapter {name} (rank {adapter_rank(index)})", flush=True)
            tmp = adapters_dir / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(path, ignore_errors=True)
            make_peft_adapter(model_dir, tmp, rank=adapter_rank(index),
                              target_modules=SUPPORTED_MODULES, seed=ADAPTER_SEED + index,
                              b_scale=ADAPTER_B_SCALE)
            tmp.rename(path)
        paths[name] = path
    return paths


def bench_adapters_dir(model_dir: str) -> Path:
    return Path(model_dir) / "bench-adapters"
