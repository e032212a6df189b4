"""Shared fixtures: tiny seeded models built in temp dirs (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.demo_model import DemoModelSpec, make_demo_model

TINY_SPEC = DemoModelSpec(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, max_position_embeddings=1024, initializer_range=0.05, seed=0,
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama (hidden 64, vocab 512) with a trained BPE tokenizer."""
    return make_demo_model(tmp_path_factory.mktemp("tiny-llama"), TINY_SPEC)
