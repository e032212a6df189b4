"""The engine: continuous batching with chunked prefill over a paged KV cache with prefix
caching and batched LoRA. LLM is the offline API; AsyncEngine the one servers drive.

Imports prefix_cache and lora, never gateway (tests/test_import_graph.py)."""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "EngineConfig", "LLMEngine", "RequestOutput",
           "SamplingParams"]
