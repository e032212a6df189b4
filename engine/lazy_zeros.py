"""Zero tensors whose memory is committed on first write, for the KV cache on a CPU.

torch.zeros writes every byte when it allocates: a 1 GiB cache costs a second of CPU and
its whole size in resident memory at every engine start, before any request. An anonymous
memory map is zero by definition and the kernel backs a page only when it is first
touched, so a cache made of one costs nothing until its blocks are used.
"""

from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous zero tensor of ``shape`` and ``dtype`` on ``device``: on a CPU in an
    anonymous memory map (page-aligned; the tensor holds the map alive), elsewhere
    torch.zeros."""
    numel = math.prod(shape)
    if device.type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(memory, dtype=dtype).view(shape)
