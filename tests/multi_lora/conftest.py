"""Eight PEFT adapters of the tiny model (ranks 4-32, mixed targets, some rsLoRA) and the
model's shape, for every module of this package."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.demo_model import make_peft_adapter
from engine.models.loader import load_hf_config
from engine.models.shape import ModelShape

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (rank, targets, rslora) of the eight test adapters: ranks 4-32, mixed targets.
ADAPTER_SPECS = [
    (4, ("q_proj", "v_proj"), False),
    (8, ALL, False),
    (16, ("gate_proj", "up_proj", "down_proj"), True),
    (32, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
    (4, ALL, True),
    (8, ("o_proj", "down_proj"), False),
    (16, ALL, False),
    (32, ("v_proj", "up_proj"), False),
]



@pytest.fixture(scope="package")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        f"ad{i}": make_peft_adapter(tiny_model_dir, root / f"ad{i}", rank=rank,
                                    target_modules=targets, seed=100 + i, use_rslora=rslora,
                                    b_scale=0.5)
        for i, (rank, targets, rslora) in enumerate(ADAPTER_SPECS)
    }


@pytest.fixture(scope="package")
def shape(tiny_model_dir: Path) -> ModelShape:
    return ModelShape.from_hf_config(load_hf_config(str(tiny_model_dir)))
