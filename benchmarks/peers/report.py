"""Pure math of the peer benchmark: runner results -> figures, ratios and the printed table.

Throughput ratios are loragate / vLLM (vLLM's median seconds over loragate's median seconds
for the same work), so above 1 loragate is faster. Latency ratios are loragate / vLLM too,
so there below 1 loragate is better. Each row says which way is better and carries the
issue's target.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

THROUGHPUT_TARGETS = {"mixed": 1.0, "rag": 1.2, "lora": 1.5}
"""Issue 17's targets for loragate / vLLM throughput per offline workload."""
TTFT_TARGET = 1.0
"""loragate TTFT p50 / vLLM's at the same request rate: at most this."""
AGREEMENT_TARGET = 1.0


@dataclass(frozen=True)
class ThroughputFigures:
    """One offline workload on both engines: the seconds of every repeat and the work done."""

    workload: str
    loragate_s: tuple[float, ...]
    vllm_s: tuple[float, ...]
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if not self.loragate_s or not self.vllm_s:
            raise ValueError(f"{self.workload}: need at least one run of each engine")

    @property
    def loragate_median_s(self) -> float:
        return statistics.median(self.loragate_s)

    @property
    def vllm_median_s(self) -> float:
        return statistics.median(self.vllm_s)

    @property
    def ratio(self) -> float:
        """loragate throughput / vLLM throughput (same work, so vLLM s / loragate s)."""
        return self.vllm_median_s / self.loragate_median_s

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"workload": self.workload, "num_requests": self.num_requests,
                               "prompt_tokens": self.prompt_tokens,
                               "output_tokens": self.output_tokens, "ratio": self.ratio,
                               "target": THROUGHPUT_TARGETS.get(self.workload)}
        for engine, seconds in (("loragate", self.loragate_s), ("vllm", self.vllm_s)):
            median = statistics.median(seconds)
            out[engine] = {"seconds": list(seconds), "median_s": median,
                           "requests_per_s": self.num_requests / median,
                           "output_tokens_per_s": self.output_tokens / median,
                           "total_tokens_per_s":
                               (self.prompt_tokens + self.output_tokens) / median}
        return out


def throughput_figures(workload: str, loragate: Sequence[dict[str, Any]],
                       vllm: Sequence[dict[str, Any]]) -> ThroughputFigures:
    """Figures of phase ``workload`` from each engine's runner results (job.py's format).
    Token counts are the requested ones (prompt lengths and output_len), taken from the
    first loragate result; mismatched output counts are the agreement check's business."""
    first = loragate[0]["phases"][workload]
    return ThroughputFigures(workload, tuple(r["phases"][workload]["seconds"] for r in loragate),
                             tuple(r["phases"][workload]["seconds"] for r in vllm),
                             len(first["output_token_ids"]), int(first["prompt_tokens"]),
                             int(first["output_tokens"]))


@dataclass(frozen=True)
class Agreement:
    """Greedy outputs of both engines compared sequence by sequence."""

    identical: int
    total: int
    first_divergence: tuple[int, ...]
    """For each differing sequence, the index of its first differing token."""

    @property
    def share(self) -> float:
        return self.identical / self.total if self.total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"identical": self.identical, "total": self.total, "share": self.share,
                "first_divergence": list(self.first_divergence), "target": AGREEMENT_TARGET}


def compare_outputs(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]
                    ) -> Agreement:
    """Identical sequences / all; a length difference counts as a divergence at the end of
    the shorter sequence."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} sequences against {len(theirs)}")
    identical, divergence = 0, []
    for a, b in zip(ours, theirs, strict=True):
        if list(a) == list(b):
            identical += 1
            continue
        divergence.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False))
                                if x != y), min(len(a), len(b))))
    return Agreement(identical, len(ours), tuple(divergence))


@dataclass(frozen=True)
class ServingRow:
    """One request rate through both OpenAI servers: latency percentiles in ms."""

    rate: float
    loragate: dict[str, float]
    vllm: dict[str, float]

    @property
    def ttft_p50_ratio(self) -> float:
        """loragate TTFT p50 / vLLM's (below 1: loragate answers first)."""
        return self.loragate["ttft_p50_ms"] / max(1e-9, self.vllm["ttft_p50_ms"])

    def to_json(self) -> dict[str, Any]:
        return {"rate": self.rate, "loragate": self.loragate, "vllm": self.vllm,
                "ttft_p50_ratio": self.ttft_p50_ratio, "target": TTFT_TARGET}


def pooled_latency(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Median over repeats of every metric of one engine at one rate."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def table(throughput: Sequence[ThroughputFigures], agreement: dict[str, Agreement],
          serving: Sequence[ServingRow]) -> str:
    """The printed summary: one line per figure with its ratio and target."""
    lines = [f"{'workload':<26}{'loragate':>14}{'vLLM':>14}{'ratio':>9}  target"]
    for f in throughput:
        lines.append(f"{f.workload + ' (s, median)':<26}{f.loragate_median_s:>14.1f}"
                     f"{f.vllm_median_s:>14.1f}{f.ratio:>8.2f}x  "
                     f">= {THROUGHPUT_TARGETS.get(f.workload, 0):.1f}x (throughput)")
    for row in serving:
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            ratio = row.loragate[key] / max(1e-9, row.vllm[key])
            target = f"<= {TTFT_TARGET:.1f}x (latency)" if key == "ttft_p50_ms" else "(latency)"
            lines.append(f"{f'serve {row.rate:g}/s {key}':<26}{row.loragate[key]:>14.0f}"
                         f"{row.vllm[key]:>14.0f}{ratio:>8.2f}x  {target}")
    for name, a in agreement.items():
        lines.append(f"{'agree ' + name:<26}{'':>14}{'':>14}{a.share:>8.0%}   "
                     f"{a.identical}/{a.total} identical"
                     + ("  (target 100%)" if name == "agreement" else ""))
    return "\n".join(lines)


def headlines(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(metric, measured, target) rows from a written peers report (the JSON that
    ``python -m benchmarks.peers`` writes): one per offline workload, per serving rate and
    for the agreement check."""
    rows = []
    for t in report.get("throughput") or []:
        rows.append((f"{t['workload']} throughput loragate / vLLM", f"{t['ratio']:.2f}x",
                     f">= {THROUGHPUT_TARGETS.get(t['workload'], 1.0):.1f}x"))
    for r in (report.get("serving") or {}).get("rows", []):
        rows.append((f"TTFT p50 loragate / vLLM at {r['rate']:g} req/s",
                     f"{r['ttft_p50_ratio']:.2f}x", f"<= {TTFT_TARGET:.1f}x"))
    if agreement := (report.get("agreement") or {}).get("agreement"):
        rows.append(("greedy agreement with vLLM (identical sequences)",
                     f"{agreement['identical']}/{agreement['total']}", "100%"))
    return rows
