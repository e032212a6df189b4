"""LoRA-capable linear layers with slot-stacked A/B buffers.

Every target projection of the base model is a LoraLinear. Its base matmul runs once for the
whole flat batch; the adapters' deltas are added after it with the segmented shrink/expand
ops, each token using the A/B of its request's slot:

    y = x @ W.T (+ bias)                         all T tokens
    y[r] += (x[r] @ lora_a[s].T) @ lora_b[s].T   tokens r of requests in slot s
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lora.adapter import LoraAdapter
from lora.ops import LoraBatchMetadata, add_lora
from lora.targets import SUPPORTED_MODULES, LoraTargets


class LoraLinear(nn.Linear):
    """nn.Linear plus optional slot-stacked LoRA buffers (set by LoraSlots).

    lora_a: [max_loras, max_rank, in_features]; lora_b: [max_loras, out_features, max_rank]
    with the adapter's scaling folded into B and ranks below max_rank zero-padded.
    """

    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, lora: LoraBatchMetadata | None = None) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if lora is not None and lora.num_segments and self.lora_a is not None:
            assert self.lora_b is not None
            add_lora(x, self.lora_a, self.lora_b, lora, y)
        return y


class LoraSlots:
    """The GPU-side (device) slots: max_loras adapters' weights, stacked per target."""

    def __init__(self, layers: Iterable[nn.Module], targets: LoraTargets, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """layers: the decoder layers, each holding the SUPPORTED_MODULES as LoraLinear
        attributes of its ``self_attn`` or ``mlp``."""
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._targets: dict[tuple[int, str], LoraLinear] = {}
        for layer_index, layer in enumerate(layers):
            for module in SUPPORTED_MODULES:
                parent = layer.self_attn if hasattr(layer.self_attn, module) else layer.mlp
                linear = getattr(parent, module)
                assert isinstance(linear, LoraLinear)
                fan_in, fan_out = targets.module_dims(module)
                linear.lora_a = torch.zeros(max_loras, max_rank, fan_in, dtype=dtype,
                                            device=device)
                linear.lora_b = torch.zeros(max_loras, fan_out, max_rank, dtype=dtype,
                                            device=device)
                self._targets[(layer_index, module)] = linear

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write an adapter into a slot; modules it does not target get zeros."""
        assert 0 <= slot < self.max_loras and adapter.rank <= self.max_rank
        for key, linear in self._targets.items():
            assert linear.lora_a is not None and linear.lora_b is not None
            linear.lora_a[slot].zero_()
            linear.lora_b[slot].zero_()
            pair = adapter.weights.get(key)
            if pair is not None:
                a, b = pair
                linear.lora_a[slot, :a.shape[0]].copy_(a)
                linear.lora_b[slot, :, :b.shape[1]].copy_(b)
