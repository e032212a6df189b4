"""The Triton kernels for this package's tests: interpreted off CUDA, native on CUDA.

TRITON_INTERPRET=1 is read when @triton.jit decorates, so `triton_ops` sets it (for this
package only) before lora.ops.sgmv_triton is first imported.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.lora_ops.oracle import HAS_CUDA


@pytest.fixture(scope="package")
def triton_ops() -> Iterator[ModuleType]:
    """lora.ops.sgmv_triton with interpreted kernels off CUDA, native kernels on CUDA."""
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as mp:
        if not HAS_CUDA:
            mp.setenv("TRITON_INTERPRET", "1")
        name = "lora.ops.sgmv_triton"
        module = importlib.import_module(name)
        if not HAS_CUDA and not module.kernels_interpreted():
            # Imported earlier (by another test) without the interpreter: decorate again.
            module = importlib.reload(sys.modules[name])
        yield module


@pytest.fixture
def interpreted(triton_ops: ModuleType) -> ModuleType:
    if not triton_ops.kernels_interpreted():
        pytest.skip("kernels compiled for CUDA; the gpu tests cover them")
    return triton_ops
