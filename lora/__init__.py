"""Multi-LoRA: PEFT adapters read and validated (adapter), their CPU tier and device slots
(manager), LoRA-capable linear layers (layers) and the batched shrink/expand ops (ops).

Imports prefix_cache at most, never engine or gateway: the engine tells it what adapters
must fit with LoraTargets (tests/test_import_graph.py)."""

from lora.adapter import LoraAdapter, load_adapter
from lora.manager import LoraManager
from lora.targets import SUPPORTED_MODULES, LoraTargets

__all__ = ["SUPPORTED_MODULES", "LoraAdapter", "LoraManager", "LoraTargets", "load_adapter"]
