"""The Triton attention kernels for this package's tests: interpreted off CUDA, native on CUDA.

TRITON_INTERPRET=1 is read when @triton.jit decorates, so the fixture sets it (for this
package only) and imports, or re-imports, the kernel modules under it. The tiny model
fixtures are served here too (tests/tiny_models.py), so that a GPU box runs this package
with `--confcutdir tests/triton_attention` and no server packages.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.tiny_models import make_tiny_adapters, make_tiny_model

HAS_CUDA = torch.cuda.is_available()
_MODULES = ("engine.triton_attention.jit_helpers", "engine.triton_attention.decode",
            "engine.triton_attention.prefill")


@pytest.fixture(scope="package")
def kernels() -> Iterator[dict[str, ModuleType]]:
    """The kernel modules by short name (decode, prefill), interpreted without CUDA."""
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as mp:
        if not HAS_CUDA:
            mp.setenv("TRITON_INTERPRET", "1")
        modules = {}
        for name in _MODULES:
            module = importlib.import_module(name)
            helpers = sys.modules["engine.triton_attention.jit_helpers"]
            if not HAS_CUDA and not helpers.kernels_interpreted(helpers.add_combine):
                module = importlib.reload(module)  # decorated earlier without the interpreter
            modules[name.rpartition(".")[2]] = module
        # The engine's LoRA kernels too, for the decode-graph tests with adapters.
        sgmv = importlib.import_module("lora.ops.sgmv_triton")
        if not HAS_CUDA and not sgmv.kernels_interpreted():
            sgmv = importlib.reload(sgmv)
        modules["sgmv"] = sgmv
        yield modules


@pytest.fixture
def device(kernels: dict[str, ModuleType]) -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-triton"))


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, Path]:
    return make_tiny_adapters(tiny_model_dir, tmp_path_factory.mktemp("tiny-adapters-triton"))
