"""Pure math of the serving benchmark: per-request records -> vLLM-style serving metrics.

Definitions (the ones vLLM's benchmark_serving reports):

- TTFT: request sent -> first streamed chunk that carries tokens.
- ITL: every gap between two consecutive token-carrying chunks of one request (a chunk that
  carries several tokens is still one gap), pooled over all requests.
- TPOT: per request, (E2E - TTFT) / (output_tokens - 1); only requests with more than one
  output token enter the TPOT statistics (for goodput a one-token request counts as TPOT 0).
- E2E: request sent -> last byte of the response.
- Throughputs divide by the benchmark duration (first send -> last response); token totals
  count successful requests only.
- Goodput: successful requests per second whose TTFT, TPOT and E2E all lie at or under every
  SLO that was given.

Percentiles interpolate linearly between order statistics (numpy's default). Statistics of an
empty sample are 0.0.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

MS = 1000.0


@dataclass(frozen=True)
class RequestRecord:
    """What the client observed for one request; times are seconds."""

    success: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    e2e_s: float = 0.0
    start_s: float = 0.0
    """Send time relative to the benchmark start."""
    status_code: int | None = None
    error: str = ""
    """Empty on success; otherwise a short reason (the server's message or the exception)."""

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output_tokens - 1); None for failed or single-token requests."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def failure_kind(self) -> str:
        """Grouping key for failures: the HTTP status if there was one, else the error head."""
        if self.status_code is not None and self.status_code != 200:
            return f"http {self.status_code}"
        return self.error.split(":", 1)[0] or "unknown"


@dataclass(frozen=True)
class SloSpec:
    """Service-level objectives in milliseconds; None means no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0, got {value}")

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, record: RequestRecord) -> bool:
        """True when a successful request meets every given objective (bounds inclusive)."""
        if not record.success:
            return False
        tpot = record.tpot_s or 0.0
        checks = ((self.ttft_ms, record.ttft_s), (self.tpot_ms, tpot), (self.e2e_ms, record.e2e_s))
        return all(slo is None or value * MS <= slo for slo, value in checks)


def with_goodput(base: SloSpec, pairs: Sequence[str]) -> SloSpec:
    """``base`` updated by vLLM-style ``--goodput`` pairs ``ttft:500 tpot:50 e2el:1000`` (ms)."""
    keys = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms", "e2e": "e2e_ms"}
    updates: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in keys:
            raise ValueError(f"goodput takes NAME:MS with NAME in ttft|tpot|e2el, got {pair!r}")
        try:
            updates[keys[name]] = float(value)
        except ValueError:
            raise ValueError(f"goodput {name} needs a number of ms, got {value!r}") from None
    return replace(base, **updates)


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median and 99th percentile of one latency sample, in milliseconds."""

    mean_ms: float
    median_ms: float
    p99_ms: float

    @classmethod
    def of_seconds(cls, values: list[float]) -> LatencyStats:
        ms = [v * MS for v in values]
        mean = sum(ms) / len(ms) if ms else 0.0
        return cls(mean, percentile(ms, 50.0), percentile(ms, 99.0))


@dataclass(frozen=True)
class ServingMetrics:
    """The aggregate a serving benchmark reports."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    """Requests/s meeting all SLOs; None when no SLO was given."""
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    failures: dict[str, int]
    """Failure kind ("http 429", "ReadTimeout", ...) -> count."""


def nearest_rank(values: list[float], q: float) -> float:
    """The value at rank round(q * (n - 1)) of the sorted values (q in 0..1), no
    interpolation: what the engine-level benchmarks report as p50 / p99."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; 0.0 for an empty list."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: list[RequestRecord], duration_s: float, slo: SloSpec) -> ServingMetrics:
    """Aggregate per-request records over a run that took ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    inputs = sum(r.prompt_len for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    good = sum(slo.met_by(r) for r in ok)
    return ServingMetrics(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        total_input_tokens=inputs, total_output_tokens=outputs,
        request_throughput=len(ok) / duration_s, output_throughput=outputs / duration_s,
        total_token_throughput=(inputs + outputs) / duration_s,
        goodput=good / duration_s if slo.any else None,
        ttft=LatencyStats.of_seconds([r.ttft_s for r in ok]),
        tpot=LatencyStats.of_seconds(tpots),
        itl=LatencyStats.of_seconds([gap for r in ok for gap in r.itl_s]),
        e2e=LatencyStats.of_seconds([r.e2e_s for r in ok]),
        failures=dict(Counter(r.failure_kind for r in records if not r.success)),
    )


def arrival_offsets(num_requests: int, rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send times in seconds from the start: the first at 0, then gamma-distributed gaps.

    Gaps have shape ``burstiness`` and scale ``1 / (rate * burstiness)``, so their mean is
    always ``1 / rate``; burstiness 1 is a Poisson process, below 1 burstier, above 1 more
    regular. ``rate = inf`` sends everything at once.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (inf for all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return offsets


def counter_totals(text: str, sample_names: tuple[str, ...]) -> dict[str, float]:
    """Sum of every sample named in ``sample_names`` across all label sets of a Prometheus
    text exposition. Matches sample names, since the parser strips ``_total`` from counter
    family names but not from their samples."""
    totals = dict.fromkeys(sample_names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals
