"""engine/lazy_zeros.py: the CPU KV cache's zero tensors, committed only where written."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

from engine.lazy_zeros import lazy_zeros

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_lazy_zero_tensor_is_an_ordinary_zero_tensor(dtype: torch.dtype) -> None:
    first, second = lazy_zeros((5, 16, 2, 8), dtype, CPU), lazy_zeros((5, 16, 2, 8), dtype, CPU)
    assert first.shape == (5, 16, 2, 8) and first.dtype == dtype and first.is_contiguous()
    assert torch.equal(first, torch.zeros_like(first))
    first[2, 3] = 1.5
    first.view(-1)[-1] = -2.0  # the last element is inside the map
    assert float(first.float().sum()) == 1.5 * 16 - 2.0
    assert torch.equal(second, torch.zeros_like(second))  # each call has its own memory
    assert first.data_ptr() % 4096 == 0  # page-aligned, as the map is


def test_an_empty_shape_is_an_empty_tensor() -> None:
    assert lazy_zeros((0, 16, 2, 8), torch.float32, CPU).shape == (0, 16, 2, 8)


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc (Linux)")
def test_only_the_pages_written_become_resident() -> None:
    before = _resident_bytes()
    cache = lazy_zeros((1024, 16, 4, 1024), torch.float32, CPU)  # 256 MiB
    cache[:16] = 1.0  # 4 MiB written
    grown = _resident_bytes() - before
    assert 4 << 20 <= grown < 64 << 20, grown
    assert float(cache[15].min()) == 1.0 and float(cache[16].max()) == 0.0
