"""LoRA-capable linear layers with slot-stacked A/B buffers.

Every target projection of the base model is a LoraLinear. Its base matmul runs once for the
whole flat batch; the adapters' deltas are added after it with the segmented shrink/expand
ops, each token using the A/B of its request's slot:

    y = x @ W.T (+ bias)                         all T tokens
    y[r] += (x[r] @ lora_a[s].T) @ lora_b[s].T   tokens r of requests in slot s

A LoraLinear may merge several projections of one input (q/k/v, gate/up) into one GEMM;
their adapters stay separate, each applied to its own slice of the output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from lora.adapter import LoraAdapter
from lora.cpu_gemm import linear as base_linear
from lora.ops import LoraBatchMetadata, add_lora
from lora.targets import SUPPORTED_MODULES, LoraTargets


class LoraLinear(nn.Linear):
    """nn.Linear plus optional slot-stacked LoRA buffers (set by LoraSlots).

    It may be several projections of one input merged along the output (q/k/v, gate/up):
    one GEMM for all of them, while each sub-projection (a "part", named as in checkpoints
    and adapters) keeps its own adapter weights and its delta lands in its own output
    columns. parts: (name, out_features) per sub-projection, in output order.

    lora_a: [max_loras, len(parts) * max_rank, in_features], the parts' A's stacked along the
    rank; lora_b: [max_loras, out_features, max_rank], their B's along the output; the
    adapter's scaling folded into B, ranks below max_rank zero-padded.
    """

    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]],
                 bias: bool = False) -> None:
        super().__init__(in_features, sum(width for _, width in parts), bias=bias)
        self.parts = tuple(name for name, _ in parts)
        self.slices = tuple(width for _, width in parts)

    def forward(self, x: torch.Tensor, lora: LoraBatchMetadata | None = None) -> torch.Tensor:
        y = base_linear(x, self.weight, self.bias)  # weight plain or prepacked (lora/cpu_gemm.py)
        if lora is not None and lora.num_segments and self.lora_a is not None:
            assert self.lora_b is not None
            add_lora(x, self.lora_a, self.lora_b, lora, y, slices=self.slices)
        return y


class LoraSlots:
    """The GPU-side (device) slots: max_loras adapters' weights, stacked per target."""

    def __init__(self, layers: Iterable[nn.Module], targets: LoraTargets, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """layers: the decoder layers; their LoraLinear submodules' parts must name each of
        SUPPORTED_MODULES once per layer, with the dims of `targets`."""
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._linears: list[LoraLinear] = []
        self._targets: dict[tuple[int, str], tuple[LoraLinear, int]] = {}
        for layer_index, layer in enumerate(layers):
            for linear in layer.modules():
                if not isinstance(linear, LoraLinear):
                    continue
                for part, (name, width) in enumerate(zip(linear.parts, linear.slices,
                                                         strict=True)):
                    assert targets.module_dims(name) == (linear.in_features, width), name
                    self._targets[(layer_index, name)] = (linear, part)
                linear.lora_a = torch.zeros(max_loras, len(linear.parts) * max_rank,
                                            linear.in_features, dtype=dtype, device=device)
                linear.lora_b = torch.zeros(max_loras, linear.out_features, max_rank,
                                            dtype=dtype, device=device)
                self._linears.append(linear)
            assert {m for i, m in self._targets if i == layer_index} == set(SUPPORTED_MODULES)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write an adapter into a slot; modules it does not target get zeros."""
        assert 0 <= slot < self.max_loras and adapter.rank <= self.max_rank
        for linear in self._linears:
            assert linear.lora_a is not None and linear.lora_b is not None
            linear.lora_a[slot].zero_()
            linear.lora_b[slot].zero_()
        for key, (linear, part) in self._targets.items():
            pair = adapter.weights.get(key)
            if pair is None:
                continue
            assert linear.lora_a is not None and linear.lora_b is not None
            a, b = pair                                   # [r, in], [out_part, r]
            row = part * self.max_rank
            col = sum(linear.slices[:part])
            linear.lora_a[slot, row:row + a.shape[0]].copy_(a)
            linear.lora_b[slot, col:col + b.shape[0], :b.shape[1]].copy_(b)
