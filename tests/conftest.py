"""Shared fixtures: tiny seeded models built in temp dirs (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.demo_model import DemoModelSpec, make_demo_model, make_peft_adapter
from gateway.sqlite_store import STATE_PATH_ENV
from lora.adapter import SUPPORTED_MODULES

# Gateways started by tests (in process or as children, which inherit this) keep tenants in
# memory unless a test gives --state-path: none shares the user's ~/.cache/loragate/state.db
# or another test's file.
os.environ[STATE_PATH_ENV] = ":memory:"

TINY_SPEC = DemoModelSpec(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, max_position_embeddings=1024, initializer_range=0.05, seed=0,
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama (hidden 64, vocab 512) with a trained BPE tokenizer."""
    return make_demo_model(tmp_path_factory.mktemp("tiny-llama"), TINY_SPEC)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, Path]:
    """Two PEFT adapters of the tiny model: a0 (q/v, rank 8) and a1 (all seven targets)."""
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        "a0": make_peft_adapter(tiny_model_dir, root / "a0", rank=8,
                                target_modules=("q_proj", "v_proj"), seed=100, b_scale=0.5),
        "a1": make_peft_adapter(tiny_model_dir, root / "a1", rank=8,
                                target_modules=SUPPORTED_MODULES, seed=101, b_scale=0.5),
    }
