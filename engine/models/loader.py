"""Load a local Hugging Face checkpoint directory into LlamaForFlatBatch (or its Gemma
subclass)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from engine import openmp_env
from engine.config import FLOAT_DTYPES
from engine.models.gemma import GemmaForFlatBatch
from engine.models.llama import LlamaForFlatBatch
from engine.models.rope import rope_tables
from engine.models.shape import ModelShape, check_architecture
from lora.cpu_gemm import native_bf16, prepack, prepack_supported
from lora.layers import LoraLinear

_DTYPES = {name: getattr(torch, name) for name in FLOAT_DTYPES}


def load_hf_config(model_dir: str) -> PretrainedConfig:
    """The checkpoint's config, with clear errors for a missing or foreign directory."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory {model_dir!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {model_dir!r} has no config.json")
    raw = _read_config_json(path / "config.json")
    check_architecture(raw.get("model_type"), raw.get("architectures"))
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"cannot read the config of {model_dir!r}: {exc}") from exc


# A model's config.json is a few kilobytes; far more is not one.
_MAX_CONFIG_BYTES = 1 << 20


def _read_config_json(path: Path) -> dict[str, Any]:
    """config.json as a dict, with a ValueError (not a JSON traceback) for anything else."""
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ValueError(f"{path.name} is over {_MAX_CONFIG_BYTES} bytes: not a model config")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path.name} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return data


def cpu_auto_dtype() -> torch.dtype:
    """What dtype="auto" runs on a CPU, whatever the checkpoint's dtype: bfloat16 where the
    CPU has AMX (its GEMMs run 3-7x the fp32 rate there), else float32 (bf16 GEMMs without
    tile units are slower than fp32 ones)."""
    return torch.bfloat16 if native_bf16() else torch.float32


def resolve_dtype(name: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return cpu_auto_dtype()
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    return _DTYPES.get(str(declared), torch.bfloat16)


def describe_placement(dtype_name: str, dtype: torch.dtype, device: torch.device) -> str:
    """What the engine's start line says after "on DEVICE": on a CPU its torch threads and
    how OpenMP waits; and a dtype chosen by "auto", with what bfloat16 changes where the
    choice was made for speed (AMX)."""
    threads = f" ({torch.get_num_threads()} threads, {openmp_env.describe()})" \
        if device.type == "cpu" else ""
    auto = " (dtype auto)" if dtype_name == "auto" else ""
    if auto and device.type == "cpu" and dtype != torch.float32:
        auto = (" (dtype auto: bfloat16 for this CPU's AMX units; greedy output can "
                "differ from float32 where two tokens nearly tie: --dtype float32 for "
                "reference parity)")
    return threads + auto


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights")
    return files


def checkpoint_layout(model: nn.Module) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Per parameter of the model, the checkpoint tensors it is made of and their shapes:
    itself, or for a merged projection (LoraLinear with several parts: q/k/v, gate/up) its
    parts' tensors under their own names, concatenated along dim 0 in this order."""
    modules = dict(model.named_modules())
    layout: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, param in model.named_parameters():
        owner_name, _, attr = name.rpartition(".")
        owner = modules[owner_name]
        if isinstance(owner, LoraLinear) and len(owner.parts) > 1:
            parent = owner_name.rpartition(".")[0]
            layout[name] = [(f"{parent}.{part}.{attr}", (width, *param.shape[1:]))
                            for part, width in zip(owner.parts, owner.slices, strict=True)]
        else:
            layout[name] = [(name, tuple(param.shape))]
    return layout


def load_model(
    model_dir: str, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
    max_positions: int, prepack_weights: bool = False, dummy_seed: int | None = None,
) -> LlamaForFlatBatch:
    """Build the model on the meta device, then assign the checkpoint's tensors to it.
    prepack_weights: on a CPU in fp32, put every projection's weight (and the LM head's)
    into oneDNN's layout (lora/cpu_gemm.py); a tied LM head then gets its own copy.
    dummy_seed: read no weight files; seeded random weights of the config's shape are built
    on the device instead (matrices N(0, initializer_range), norm weights one, biases
    zero)."""
    shape = ModelShape.from_hf_config(config)
    cos, sin = rope_tables(config, shape.head_dim, max_positions, shape.rope_kinds)
    model_class = GemmaForFlatBatch if shape.is_gemma else LlamaForFlatBatch
    with torch.device("meta"):
        model = model_class(shape, cos.to("meta"), sin.to("meta"))
    if dummy_seed is not None:
        params = _dummy_params(model, dummy_seed, float(getattr(config, "initializer_range", 0.02)),
                               dtype, device)
        return _finish(model, params, cos, sin, device, prepack_weights)
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(Path(model_dir)):
        state.update(load_file(str(file), device="cpu"))
    if shape.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight", torch.empty(0))
    layout = checkpoint_layout(model)
    missing = sorted(key for parts in layout.values() for key, _ in parts if key not in state)
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks weights: {missing[:5]}")
    for parts in layout.values():
        for key, expected in parts:
            if tuple(state[key].shape) != expected:
                raise ValueError(f"weight {key} has shape {tuple(state[key].shape)}, the "
                                 f"config implies {expected}")
    params = {name: state[parts[0][0]] if len(parts) == 1
              else torch.cat([state.pop(key) for key, _ in parts])
              for name, parts in layout.items()}
    params = {k: v.to(device=device, dtype=dtype) for k, v in params.items()}
    return _finish(model, params, cos, sin, device, prepack_weights)


def _dummy_params(model: nn.Module, seed: int, std: float, dtype: torch.dtype,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """Random weights for every parameter of the meta-device model, generated on the
    device itself (an 8B shape is 16 GB: no host copy, no files)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    params: dict[str, torch.Tensor] = {}
    for name, meta in model.named_parameters():
        if name.endswith("bias"):
            params[name] = torch.zeros(meta.shape, dtype=dtype, device=device)
        elif meta.dim() == 1:
            params[name] = torch.ones(meta.shape, dtype=dtype, device=device)
        else:
            params[name] = torch.empty(meta.shape, dtype=dtype, device=device).normal_(
                0.0, std, generator=generator)
    return params


def _finish(model: LlamaForFlatBatch, params: dict[str, torch.Tensor], cos: torch.Tensor,
            sin: torch.Tensor, device: torch.device, prepack_weights: bool) -> LlamaForFlatBatch:
    """Assign the weights and rope tables, switch to inference, prepack if asked."""
    model.load_state_dict(params, strict=True, assign=True)
    model.rope_cos = cos.to(device)
    model.rope_sin = sin.to(device)
    model = model.eval().requires_grad_(False)
    if prepack_weights:
        for module in model.modules():
            if isinstance(module, nn.Linear) and prepack_supported(module.weight):
                module.weight = nn.Parameter(prepack(module.weight), requires_grad=False)
    return model
