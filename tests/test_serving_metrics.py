"""Serving benchmark math: percentiles, TTFT/ITL/TPOT/E2E, throughput, goodput, arrivals and
Prometheus counter deltas. Times are dyadic fractions so every float is exact."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from benchmarks.serving_metrics import (
    LatencyStats,
    RequestRecord,
    SloSpec,
    arrival_offsets,
    counter_totals,
    percentile,
    summarize,
    with_goodput,
)


def ok(prompt_len: int, output_tokens: int, ttft: float, itl: tuple[float, ...], e2e: float
       ) -> RequestRecord:
    return RequestRecord(True, prompt_len, output_tokens, ttft_s=ttft, itl_s=itl, e2e_s=e2e,
                         status_code=200)


def failed(status: int | None, error: str) -> RequestRecord:
    return RequestRecord(False, 100, status_code=status, error=error)


# Request A: 5 tokens, first after 125 ms, done at 625 ms -> TPOT (625 - 125) / 4 = 125 ms.
A = ok(10, 5, 0.125, (0.125, 0.25, 0.125), 0.625)
# Request B: 3 tokens, first after 250 ms, done at 500 ms -> TPOT (500 - 250) / 2 = 125 ms.
B = ok(20, 3, 0.25, (0.25,), 0.5)
# Request C: a single token at 500 ms: no TPOT sample, TPOT 0 for goodput.
C = ok(30, 1, 0.5, (), 0.5)


# ------------------------------------------------------------------------ percentile
def test_percentile_interpolates_linearly() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile(values, 99) == pytest.approx(3.97, abs=1e-12)  # rank 2.97
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError, match="101"):
        percentile(values, 101)


def stats(mean: float, median: float, p99: float) -> LatencyStats:
    """Expected stats; approx only absorbs the last bit of the 0.99 * (n - 1) rank."""
    approx = [pytest.approx(v, abs=1e-9) for v in (mean, median, p99)]
    return LatencyStats(*approx)  # type: ignore[arg-type]


def test_latency_stats_are_milliseconds() -> None:
    # [125, 250, 500] ms: p99 rank 1.98 -> 250 + 0.98 * 250.
    assert LatencyStats.of_seconds([0.125, 0.25, 0.5]) == stats(875 / 3, 250.0, 495.0)
    assert LatencyStats.of_seconds([]) == LatencyStats(0.0, 0.0, 0.0)


# ------------------------------------------------------------------------ per request
def test_tpot_excludes_the_first_token() -> None:
    assert A.tpot_s == 0.125
    assert B.tpot_s == 0.125
    assert C.tpot_s is None
    assert failed(500, "x").tpot_s is None


def test_failure_kind_prefers_the_status_code() -> None:
    assert failed(429, "rate limited").failure_kind == "http 429"
    assert failed(200, "ServerError: out of blocks").failure_kind == "ServerError"
    assert failed(None, "ConnectError: refused").failure_kind == "ConnectError"
    assert failed(None, "").failure_kind == "unknown"


# ------------------------------------------------------------------------ aggregate
def test_summarize_counts_only_successes_in_tokens_and_latencies() -> None:
    records = [A, B, C, failed(429, "quota"), failed(429, "quota"), failed(200, "Truncated: x")]
    m = summarize(records, duration_s=2.0, slo=SloSpec())
    assert (m.completed, m.failed) == (3, 3)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 9)
    assert m.request_throughput == 1.5
    assert m.output_throughput == 4.5
    assert m.total_token_throughput == 34.5
    assert m.goodput is None
    assert m.ttft == stats(875 / 3, 250.0, 495.0)
    assert m.tpot == LatencyStats(125.0, 125.0, 125.0)  # C has no TPOT sample
    assert m.itl == LatencyStats(187.5, 187.5, 250.0)  # pooled gaps 125, 250, 125, 250
    assert m.e2e == stats(1625 / 3, 500.0, 622.5)  # [500, 500, 625]
    assert m.failures == {"http 429": 2, "Truncated": 1}


def test_goodput_requires_every_slo_with_inclusive_bounds() -> None:
    records = [A, B, C, failed(503, "no engine")]
    # TTFT <= 250 ms passes A and B (B exactly on the bound), fails C.
    assert summarize(records, 2.0, SloSpec(ttft_ms=250)).goodput == 1.0
    # TPOT < 125 ms fails A and B; C's single token counts as TPOT 0.
    assert summarize(records, 2.0, SloSpec(tpot_ms=124)).goodput == 0.5
    # All three together: only B meets TTFT 250, TPOT 125 and E2E 500.
    assert summarize(records, 2.0, SloSpec(250, 125, 500)).goodput == 0.5
    assert summarize(records, 4.0, SloSpec(e2e_ms=1000)).goodput == 0.75


def test_slo_validation_and_goodput_pairs() -> None:
    with pytest.raises(ValueError, match="ttft_ms"):
        SloSpec(ttft_ms=0)
    assert with_goodput(SloSpec(ttft_ms=100), ["tpot:50", "e2el:900"]) == SloSpec(100, 50, 900)
    with pytest.raises(ValueError, match="latency:5"):
        with_goodput(SloSpec(), ["latency:5"])
    with pytest.raises(ValueError, match="fast"):
        with_goodput(SloSpec(), ["ttft:fast"])
    with pytest.raises(ValueError, match="duration_s"):
        summarize([A], 0.0, SloSpec())


# ------------------------------------------------------------------------ arrivals
def test_arrivals_are_seeded_and_start_at_zero() -> None:
    first = arrival_offsets(50, rate=4.0, burstiness=1.0, seed=7)
    assert first == arrival_offsets(50, rate=4.0, burstiness=1.0, seed=7)
    assert first != arrival_offsets(50, rate=4.0, burstiness=1.0, seed=8)
    assert first[0] == 0.0
    assert all(b > a for a, b in itertools.pairwise(first))


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_mean_gap_is_one_over_rate_and_burstiness_sets_the_spread(burstiness: float) -> None:
    rate, n = 8.0, 20_000
    offsets = arrival_offsets(n + 1, rate, burstiness, seed=0)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    # Gamma(shape=k, scale=1/(rate*k)): coefficient of variation 1/sqrt(k).
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(5, math.inf, burstiness=0.3) == [0.0] * 5
    assert arrival_offsets(0, 2.0) == []
    for bad_rate in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="rate"):
            arrival_offsets(3, bad_rate)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, 1.0, burstiness=0.0)


# ------------------------------------------------------------------------ prometheus
METRICS_TEXT = """\
# HELP loragate_prefix_cache_hit_tokens_total Prompt tokens served from the prefix cache.
# TYPE loragate_prefix_cache_hit_tokens_total counter
loragate_prefix_cache_hit_tokens_total{instance="0",lora="base"} 120.0
loragate_prefix_cache_hit_tokens_total{instance="1",lora="demo-0"} 30.0
loragate_prefix_cache_hit_tokens_created{instance="0",lora="base"} 1.7e9
# HELP loragate_prefix_cache_query_tokens_total Prompt tokens looked up.
# TYPE loragate_prefix_cache_query_tokens_total counter
loragate_prefix_cache_query_tokens_total{instance="0"} 400.0
loragate_prefix_cache_query_tokens_total{instance="1"} 200.0
# TYPE loragate_requests_total counter
loragate_requests_total 9.0
"""


def test_counter_totals_sum_samples_over_series() -> None:
    names = ("loragate_prefix_cache_hit_tokens_total", "loragate_prefix_cache_query_tokens_total",
             "loragate_missing_total")
    assert counter_totals(METRICS_TEXT, names) == {
        "loragate_prefix_cache_hit_tokens_total": 150.0,
        "loragate_prefix_cache_query_tokens_total": 600.0,
        "loragate_missing_total": 0.0,
    }


def test_nearest_rank_picks_a_sample_without_interpolating() -> None:
    from benchmarks.serving_metrics import nearest_rank

    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [nearest_rank(values, q) for q in (0.0, 0.5, 0.99, 1.0)] == [1.0, 3.0, 5.0, 5.0]
    assert nearest_rank([1.0, 2.0], 0.5) == 1.0  # rank 0.5 rounds half to even: 0
