"""Compiled CPU kernels, built on first use with the host's C++ compiler.

``paged_decode_attention`` (paged_decode_attention.cpp) is decode attention reading the
paged KV cache in place. torch's CPU flash kernel needs each context copied out of the cache
into a dense tensor and tiles its work for long query blocks; a decode has one query per
head, so on CPU that path spent most of a decode step copying and padding.

``span_attention`` (span_attention.cpp) is cascade attention's per-layer work in one call:
the query rows of each shared prefix node, and each prefill chunk's rows causally over its own
K/V, against keys read in place, then every row's partial results merged. torch's CPU flash
kernel, which it replaces there, ran at about half the GEMM rate on these shapes, computed
the masked half of causal chunks, and needed a call per node plus a dozen ops of merging per
layer.

``FusedOps`` (fused_elementwise.cpp) are a Llama layer's element-wise steps in one pass each:
RMSNorm, residual add + RMSNorm, rotary embedding in place, SiLU-and-multiply. Eager torch
runs four to ten ops (and their temporaries) for each; in a decode step of a 30-layer model
those ops cost more than their arithmetic. (torch.compile of the same functions was measured
too: ~40-80 us per compiled call here, more than the eager ops at decode sizes.)

The extension is compiled with torch's cpp_extension (g++ and ninja, a minute or two once;
cached under TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions, from copies of the
sources kept there, so every checkout and venv with the same sources and torch shares one
build) for this
machine's instruction set (``-march=native``; ``LORAGATE_CPU_MARCH`` names another target on
x86, e.g. ``haswell`` for an image built on one machine and run on AVX2 ones), with OpenMP so
that at::parallel_for uses torch's threads (the runtime torch already loaded). Where it cannot
be built, the loaders say why once in the log and return None, and the engine keeps its
torch paths (as it does with EngineConfig.native_kernels off).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("paged_decode_attention.cpp", "fused_elementwise.cpp",
                        "span_attention.cpp")]
HEADERS = [Path(__file__).with_name("vec_math.h")]

PagedDecodeOp = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(q, k_cache, v_cache, block_tables, context_lens, scale, softcap, window) -> (out, lse);
semantics, shapes and dtypes in paged_decode_attention.cpp."""

SpanAttentionOp = Callable[..., torch.Tensor]
"""(q, k_cache, v_cache, k_copy, v_copy, k_step, v_step, items, rows, prior_out, prior_lse,
merge_offsets, merge_parts, scale) -> out; semantics, shapes and dtypes in
span_attention.cpp."""


@dataclass(frozen=True)
class FusedOps:
    """The fused element-wise ops; semantics, shapes and dtypes in fused_elementwise.cpp."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x [T, N], weight [N], eps) -> [T, N]"""
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]]
    """(x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)"""
    rotary_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    """(q [T, H, D], k [T, Hkv, D], cos, sin [T, D]) -> None; rotates q and k in place"""
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    """(gate_up [T, 2I]) -> silu(gate) * up [T, I]"""


_lock = threading.Lock()
_built: list[bool] = []  # [] before the first attempt, then [whether it built]


MARCH_ENV = "LORAGATE_CPU_MARCH"
"""The x86 target the kernels are compiled for (gcc's -march; default native)."""


def _march() -> str:
    return os.environ.get(MARCH_ENV, "") or "native"


def _build_tag() -> str:
    """Part of the build's name: a build for one instruction set is never loaded on
    another (the cache directory may be shared between machines), changed sources or headers
    build apart, as does another torch or Python (the extension links against both)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    # The sources too: checkouts with other sources get their own build directory, rather
    # than rebuilding one in turn (the staged copies are rewritten by each).
    code = b"".join(path.read_bytes() for path in (*HEADERS, *SOURCES))
    target = (f"{platform.machine()} {_march()} {flags} torch {torch.__version__} "
              f"python {sys.version_info.major}.{sys.version_info.minor}{sys.abiflags}")
    return hashlib.sha256(target.encode() + code).hexdigest()[:10]


BUILT_MARK = "loragate.built"
"""Created in the build directory once a build there succeeded (its .so is whole)."""
TORCH_BATON = "lock"
"""The file torch's cpp_extension creates in the build directory while it builds, and waits
(forever) for as long as it exists."""


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an OS lock on build_dir while building into it.

    torch's own lock is a file that exists while a build runs; a build that is killed (Ctrl-C
    or SIGKILL during a first ``loragate serve``) leaves it behind, and every later start then
    waits for it forever. Every build of ours takes this lock first, and the kernel releases it
    when its holder dies: whoever holds it knows no build of ours is running, so a torch lock
    file found then was left by a dead one and is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "loragate.flock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building the CPU kernels into %s; waiting for it",
                     build_dir)
            fcntl.flock(held, fcntl.LOCK_EX)
        baton = build_dir / TORCH_BATON
        if baton.exists():
            log.warning("removing %s, left by a kernel build that was stopped", baton)
            baton.unlink(missing_ok=True)
        yield  # closing the file on the way out releases the lock


def build_directory(name: str) -> Path:
    """Where the build named name lives: under TORCH_EXTENSIONS_DIR, by default torch's
    cache root (~/.cache/torch_extensions)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


def _stage_sources(build_dir: Path) -> list[Path]:
    """Copies of the sources and headers inside the build directory, rewritten only when
    their content changed: ninja rebuilds when a command line changes, and the command
    names the sources' paths, so building from each checkout's own files made every other
    checkout or installed copy sharing the cache (a CI clone, a second venv) compile again,
    and two of them used at once rebuilt each other's builds in turn."""
    staged_dir = build_dir / "src"
    staged_dir.mkdir(parents=True, exist_ok=True)
    for original in (*SOURCES, *HEADERS):
        content = original.read_bytes()
        staged = staged_dir / original.name
        if not staged.exists() or staged.read_bytes() != content:
            partial = staged.with_suffix(staged.suffix + ".partial")
            partial.write_bytes(content)
            partial.replace(staged)
    return [staged_dir / source.name for source in SOURCES]


def _build() -> bool:
    """Compile (or load the cached build of) the extension once per process."""
    with _lock:
        if not _built:
            try:
                from torch.utils.cpp_extension import load

                log.info("loading the compiled CPU kernels (built once for this machine: a "
                         "minute or two)")
                x86 = platform.machine() in ("x86_64", "AMD64")
                native = [f"-march={_march()}"] if x86 else []
                name = f"loragate_cpu_kernels_{_build_tag()}"
                build_dir = build_directory(name)
                with build_lock(build_dir):
                    built = build_dir / f"{name}.so"
                    done = build_dir / BUILT_MARK
                    if built.is_file() and done.is_file():
                        # The name holds everything the build depends on (sources, target,
                        # torch, Python): loaded as is. ninja would rebuild for another venv,
                        # whose torch headers' path is in its command lines.
                        torch.ops.load_library(str(built))
                    else:
                        done.unlink(missing_ok=True)
                        sources = _stage_sources(build_dir)
                        load(name=name, sources=[str(s) for s in sources],
                             extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast", *native],
                             extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                             is_python_module=False, verbose=False)
                        done.touch()
                _built.append(True)
            except Exception as exc:
                log.warning("compiled CPU kernels unavailable (%s: %s); the engine uses its "
                            "torch paths", type(exc).__name__, exc)
                _built.append(False)
        return _built[0]


def load_paged_decode() -> PagedDecodeOp | None:
    """The compiled decode kernel, built on the first call; None where it cannot be built
    (the reason is logged once)."""
    if not _build():
        return None
    op: PagedDecodeOp = torch.ops.loragate.paged_decode_attention
    return op


# Below 8 floats per vector register (SSE, NEON) the span kernel's micro-kernels are slower
# than torch's flash kernel (measured on an SSE2 build: 3x), which cascade attention keeps.
_MIN_SPAN_VECTOR_WIDTH = 8


def load_span_attention() -> SpanAttentionOp | None:
    """The compiled span attention (cascade attention's nodes, chunks and merge in one call),
    from the same build as load_paged_decode; None where it cannot be built or where this
    machine's vectors are too narrow for it to pay."""
    if not _build():
        return None
    width = int(torch.ops.loragate.vector_width())
    if width < _MIN_SPAN_VECTOR_WIDTH:
        log.info("span attention off: %d-float vectors on this machine", width)
        return None
    op: SpanAttentionOp = torch.ops.loragate.span_attention
    return op


def load_fused_ops() -> FusedOps | None:
    """The fused element-wise ops, from the same build as load_paged_decode."""
    if not _build():
        return None
    ops = torch.ops.loragate
    return FusedOps(rms_norm=ops.rms_norm, add_rms_norm=ops.add_rms_norm, rotary_=ops.rotary_,
                    silu_and_mul=ops.silu_and_mul)
