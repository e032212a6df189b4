"""Compiled CPU kernels, built on first use with the host's C++ compiler.

``paged_decode_attention`` (paged_decode_attention.cpp) is decode attention reading the
paged KV cache in place. torch's CPU flash kernel needs each context copied out of the cache
into a dense tensor and tiles its work for long query blocks; a decode has one query per
head, so on CPU that path spent most of a decode step copying and padding.

The extension is compiled with torch's cpp_extension (g++ and ninja, ~20 s once; cached
under TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions) for this machine's
instruction set. Where it cannot be built, ``load_paged_decode`` says why once in the log and
returns None, and the engine keeps its torch path (as it does with EngineConfig.native_kernels
off).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode_attention.cpp")

PagedDecodeOp = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, window) -> (out, lse);
semantics, shapes and dtypes in paged_decode_attention.cpp."""

_lock = threading.Lock()
_state: dict[str, PagedDecodeOp | None] = {}


def _host_tag() -> str:
    """Part of the build's name: a build for one instruction set is never loaded on
    another (the cache directory may be shared between machines)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _build() -> PagedDecodeOp:
    from torch.utils.cpp_extension import load

    log.info("loading the compiled CPU kernels (built once for this machine, ~20 s)")
    native = ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []
    load(name=f"loragate_cpu_kernels_{_host_tag()}", sources=[str(SOURCE)],
         extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast", *native],
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    op: PagedDecodeOp = torch.ops.loragate.paged_decode_attention
    return op


def load_paged_decode() -> PagedDecodeOp | None:
    """The compiled kernel, built on the first call; None where it cannot be built (the
    reason is logged once)."""
    with _lock:
        if "op" not in _state:
            try:
                _state["op"] = _build()
            except Exception as exc:
                log.warning("compiled CPU kernels unavailable (%s: %s); decode attention "
                            "uses the torch path", type(exc).__name__, exc)
                _state["op"] = None
        return _state["op"]
