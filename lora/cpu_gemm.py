"""Base-model GEMMs on a CPU through oneDNN, with weights prepacked once at load.

torch's fp32 ``F.linear`` on a CPU calls the BLAS torch was built with (MKL). On the AMD
EPYC (AVX-512) hosts this project benchmarks on, MKL's sgemm reaches ~95 GFLOP/s per core
for the model's shapes, while oneDNN, given the weight reordered once into its own blocked
layout, reaches 2-2.5x that for every batch size from one decode token to a 512-token
prefill chunk (benchmarks/forward_profile.py). So the loader may replace each projection's
weight by its packed copy: an mkldnn-layout tensor of the same shape, dtype and values, and
``linear`` dispatches on the layout. Results agree with F.linear to fp32 rounding (only the
order of the dot products' accumulation differs).

On CPUs with AMX (Intel Sapphire Rapids and later), oneDNN runs bfloat16 GEMMs on the tile
units: 3-7x the fp32 rate for prefill-sized batches on the Xeon measured (4.0x for a
512-token chunk of the default model's MLP), so bfloat16 weights are packed there too, and
``native_bf16`` is what makes "auto" pick bfloat16 on such a CPU (engine/models/loader.py).

Lives in ``lora`` because LoraLinear (lora/layers.py) is every projection of the model.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware tiles (AMX), as torch's CPU
    feature probe reports it (it also checks that the OS lets processes use the tiles)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def prepack_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` can be prepacked: a CPU tensor, fp32 (or bf16 on a CPU with AMX),
    and a torch with oneDNN."""
    packable = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                                 and native_bf16())
    return (weight.device.type == "cpu" and packable
            and not weight.is_mkldnn and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight -> the same weight in oneDNN's blocked layout (for any batch size)."""
    assert prepack_supported(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias): x [T, in] -> [T, out], weight plain or prepacked."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
