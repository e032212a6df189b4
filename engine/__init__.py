"""The engine: continuous batching with chunked prefill over a paged KV cache with prefix
caching and batched LoRA. LLM is the offline API; AsyncEngine the one servers drive.

Imports prefix_cache and lora, never gateway (tests/test_import_graph.py).

The names below load on first use (PEP 562): importing a light submodule such as
engine.http.auth (the gateway does, for the shared token) must not import torch and the
model code, which a gateway attached to remote engines never runs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.request import RequestOutput
    from engine.sampling_params import SamplingParams

_HOMES = {"AsyncEngine": "engine.async_engine", "EngineConfig": "engine.config",
          "LLM": "engine.llm", "LLMEngine": "engine.llm_engine",
          "RequestOutput": "engine.request", "SamplingParams": "engine.sampling_params"}
"""public name -> the module that defines it."""

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "LLMEngine", "RequestOutput",
           "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
