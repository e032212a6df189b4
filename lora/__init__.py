"""Multi-LoRA: PEFT adapters read and validated (adapter), their CPU tier and device slots
(manager), LoRA-capable linear layers (layers) and the batched shrink/expand ops (ops).

Imports prefix_cache at most, never engine or gateway: the engine tells it what adapters
must fit with LoraTargets (tests/test_import_graph.py).

The names below load on first use (PEP 562): the gateway imports lora.adapter_info and
lora.targets, which must not bring torch with them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lora.adapter import LoraAdapter, load_adapter
    from lora.manager import LoraManager
    from lora.targets import SUPPORTED_MODULES, LoraTargets

_HOMES = {"LoraAdapter": "lora.adapter", "load_adapter": "lora.adapter",
          "LoraManager": "lora.manager", "SUPPORTED_MODULES": "lora.targets",
          "LoraTargets": "lora.targets"}
"""public name -> the module that defines it."""

__all__ = ["SUPPORTED_MODULES", "LoraAdapter", "LoraManager", "LoraTargets", "load_adapter"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'lora' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
