"""LoraTargets: what an adapter must fit, given by the engine (lora never reads a model
config itself, so the package chain stays prefix_cache -> lora -> engine -> gateway)."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")
"""The projections of a decoder layer an adapter may patch, in the order layers hold them."""


@dataclass(frozen=True)
class LoraTargets:
    """The base model as adapters see it: its decoder layer count and the (in_features,
    out_features) of each supported projection, the same in every layer."""

    num_layers: int
    dims: tuple[tuple[int, int], ...]
    """(in, out) per module of SUPPORTED_MODULES, in that order."""
    model_type: str
    """config.json's model_type: PEFT's default targets for a config that names none
    depend on it (lora/peft_targets.py)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if len(self.dims) != len(SUPPORTED_MODULES) or any(
                d < 1 for pair in self.dims for d in pair):
            raise ValueError(f"dims must hold a positive (in, out) pair for each of "
                             f"{SUPPORTED_MODULES}, got {self.dims}")

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target module."""
        return self.dims[SUPPORTED_MODULES.index(module)]

    def max_adapter_bytes(self, max_rank: int) -> int:
        """Bytes of the largest adapter an engine with max_lora_rank=max_rank can load: every
        supported module of every layer at that rank, in float32 (the widest dtype PEFT
        saves)."""
        return self.num_layers * sum(i + o for i, o in self.dims) * max_rank * 4
