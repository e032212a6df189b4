"""Where each engine's time goes, op by op: torch's profiler over a runner's timed phases.

With ``--profile-ops`` each runner wraps its timed generate calls in
``torch.profiler.profile`` (CPU activity only) and adds, per phase, the self time of every op
it saw (``ops``: name -> seconds) to its result; vLLM then runs its engine core in the
runner's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the profiler sees it.
``kind_table`` sums both engines' ops into kinds (GEMMs, attention, the rest of the forward)
and prints them side by side. Self time is time on the thread that called the op, worker
threads included in the op's span, so kinds add up to about the phase's wall time; what no
op covers (Python, scheduling, sampling in Python) is the remainder. Profiling costs time
per op, so the figures are for comparing shares, not for the throughput table.

Runs under both venvs' interpreters: imports only the standard library (and torch, lazily).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

OP_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "attn", "flash", "sdpa", "paged", "softmax")),
    ("gemm", ("linear", "addmm", "aten::mm", "bmm", "matmul", "gemm", "mkldnn", "onednn")),
    ("kv write", ("reshape_and_cache", "index_put", "index_copy", "scatter")),
    ("norm, rope, act", ("norm", "rotary", "rope", "silu", "gelu", "act_and_mul",
                         "cpp_fused", "triton_")),
    ("sampling", ("sort", "topk", "argmax", "multinomial", "log_softmax", "cumsum")),
)
"""Kinds by substring of the lower-cased op name, first match wins."""

TOP_OPS = 60
"""Ops kept per phase in a result (by self time); the rest are summed under "(other ops)"."""


@contextlib.contextmanager
def profiled(enabled: bool) -> Iterator[dict[str, float]]:
    """Profile the block when enabled; the yielded dict is filled on exit with op name ->
    self seconds (empty when disabled)."""
    ops: dict[str, float] = {}
    if not enabled:
        yield ops
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield ops
    totals = sorted(((e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()),
                    key=lambda kv: -kv[1])
    ops.update(totals[:TOP_OPS])
    rest = sum(seconds for _, seconds in totals[TOP_OPS:])
    if rest:
        ops["(other ops)"] = rest


def kind_of(op: str) -> str:
    name = op.lower()
    for kind, needles in OP_KINDS:
        if any(n in name for n in needles):
            return kind
    return "other ops"


def by_kind(ops: dict[str, float], wall_s: float) -> dict[str, float]:
    """Seconds per kind, and what no op covered (the phase's wall time minus all ops)."""
    kinds: dict[str, float] = {}
    for op, seconds in ops.items():
        kind = kind_of(op)
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    kinds["outside ops"] = max(0.0, wall_s - sum(ops.values()))
    return kinds


def kind_table(phase: str, ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """Both engines' profiled phase by kind, plus each engine's five heaviest ops."""
    a = by_kind(ours["ops"], ours["seconds"])
    b = by_kind(theirs["ops"], theirs["seconds"])
    lines = [f"{phase}, profiled: loragate {ours['seconds']:.1f} s, vLLM "
             f"{theirs['seconds']:.1f} s (profiler overhead included)",
             f"  {'kind':<18}{'loragate':>10}{'vLLM':>10}"]
    for kind in [k for k, _ in OP_KINDS] + ["other ops", "outside ops"]:
        lines.append(f"  {kind:<18}{a.get(kind, 0.0):>9.2f}s{b.get(kind, 0.0):>9.2f}s")
    for name, result in (("loragate", ours), ("vLLM", theirs)):
        top = sorted(result["ops"].items(), key=lambda kv: -kv[1])[:5]
        lines.append(f"  {name} heaviest: " + "; ".join(f"{op} {s:.2f}s" for op, s in top))
    return "\n".join(lines)
