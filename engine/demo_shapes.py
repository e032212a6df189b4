"""The demo model's sizes (DemoModelSpec) and the named shapes of `loragate make-demo`.

Apart from engine/demo_model.py, which builds the model, so that the CLI can list the shapes
without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoModelSpec:
    """Size of the demo model. The default is about 32M parameters: big enough that batching
    matters on a CPU, small enough to serve there."""

    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size must be >= 300 (256 bytes + specials), got "
                             f"{self.vocab_size}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads "
                             f"({self.num_heads}), which must divide by num_kv_heads "
                             f"({self.num_kv_heads})")


WIDE_SPEC = DemoModelSpec(hidden_size=1024, intermediate_size=3584, num_layers=4, num_heads=8,
                          num_kv_heads=2)
"""A demo shape whose FLOPs split more like a real model's at RAG context lengths: head_dim
128, GQA 4:1 and an MLP 3.5x the hidden size, as in Llama 3. Attention over a context of
L positions costs 4 * L * hidden FLOPs per token and layer beside the projections'
2 * params; at L = 1,300 that is ~20% of a token's FLOPs here (Qwen2.5-0.5B ~13%, Llama-3-8B
~5%) against ~45% in the default shape, whose small hidden size makes long contexts
unrealistically dear. About 71M parameters; runs at half the default's tokens/s on a CPU."""

SHAPES = {"demo": DemoModelSpec(), "wide": WIDE_SPEC}
"""Named shapes for ``loragate make-demo --shape``."""
