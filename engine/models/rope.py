"""Rotary position tables: the inverse frequencies of each rope_type, as cos/sin tables.

The engine looks positions up in one precomputed [max_positions, head_dim] table, so only
scalings whose frequencies do not depend on the sequence length are served: "default",
"linear", "llama3" (computed here) and "yarn" (computed by transformers' own init function).
"dynamic" and "longrope" change the table with the length and are refused at load.

A config may hold one rope or, as Gemma 3 does, one per layer type (``rope_parameters`` keyed
by "full_attention" and "sliding_attention": the global and the local rope). Each is a table
of its own; ModelShape says which table each layer reads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict[str, Any]:
    """The config's rope parameters, or those of one layer type when the config nests them
    (transformers folds a legacy ``rope_scaling``, ``rope_theta`` and Gemma 3's
    ``rope_local_base_freq`` into ``rope_parameters`` when it reads config.json)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params.get(layer_type) or {})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", 10000.0)
    return params


def check_rope(config: PretrainedConfig, layer_type: str | None = None) -> None:
    """Raise ValueError for rope settings the precomputed table cannot express."""
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    where = f" ({layer_type} layers)" if layer_type else ""
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r}{where} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor {partial}{where} is not supported (only 1.0)")


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] fp32: theta ** (-2i / head_dim), the unscaled rotary frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor`` are kept, those longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, and the
    band between blends the two linearly in ``original_max / wavelength``."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    # blend = 0 at the long-wavelength edge of the band (fully stretched), 1 at the short one.
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    stretched = inv_freq / factor
    mixed = (1 - blend) * stretched + blend * inv_freq
    keep = wavelength < original / high
    stretch = wavelength > original / low
    return torch.where(keep, inv_freq, torch.where(stretch, stretched, mixed))


def rope_cos_sin(config: PretrainedConfig, head_dim: int, max_positions: int,
                 layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_positions, head_dim] fp32 cos and sin tables, laid out as transformers' rotary
    embedding (each frequency twice: first half, second half). layer_type picks one of the
    config's per-layer-type ropes (None: its only one)."""
    check_rope(config, layer_type)
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    inv_freq = default_inv_freq(float(params["rope_theta"]), head_dim)  # [head_dim / 2]
    attention_scaling = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, params)
    elif rope_type == "yarn":
        by_type = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["yarn"](
            config, torch.device("cpu"), **by_type)
    positions = torch.arange(max_positions, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def rope_tables(config: PretrainedConfig, head_dim: int, max_positions: int,
                rope_kinds: tuple[str | None, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """[K, max_positions, head_dim] fp32 cos and sin: one table per entry of rope_kinds
    (ModelShape.rope_kinds), in that order."""
    tables = [rope_cos_sin(config, head_dim, max_positions, kind) for kind in rope_kinds]
    return (torch.stack([cos for cos, _ in tables]), torch.stack([sin for _, sin in tables]))
