"""The tiny seeded model and adapters the tests share, built in temp dirs (no downloads).

The root conftest serves them as session fixtures; tests/triton_attention's conftest serves the
same fixtures itself, so that package's gpu tests run on a GPU box with only the engine's
packages (the root conftest also imports the gateway's stores, which need redis)."""

from __future__ import annotations

from pathlib import Path

from engine.demo_model import make_demo_model, make_peft_adapter
from engine.demo_shapes import DemoModelSpec
from lora.targets import SUPPORTED_MODULES

TINY_SPEC = DemoModelSpec(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, max_position_embeddings=1024, initializer_range=0.05, seed=0,
)


def make_tiny_model(root: Path) -> Path:
    """A 2-layer GQA Llama (hidden 64, vocab 512) with a trained BPE tokenizer."""
    return make_demo_model(root, TINY_SPEC)


def make_tiny_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    """Two PEFT adapters of the tiny model: a0 (q/v, rank 8) and a1 (all seven targets)."""
    return {
        "a0": make_peft_adapter(model_dir, root / "a0", rank=8,
                                target_modules=("q_proj", "v_proj"), seed=100, b_scale=0.5),
        "a1": make_peft_adapter(model_dir, root / "a1", rank=8,
                                target_modules=SUPPORTED_MODULES, seed=101, b_scale=0.5),
    }
