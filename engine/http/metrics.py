"""Prometheus metrics of one engine instance.

Gauges and counters are read from the engine's latest EngineStats at scrape time (a custom
collector: the step loop never calls into prometheus_client); latency histograms are
observed on the event loop as outputs stream out (AsyncEngine.on_output). Each engine has
its own registry, so several engines in one process (tests) never share series; the engine
server exposes it on its /metrics, a gateway with an in-process engine on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.async_engine import AsyncEngine
from engine.metrics import EngineStats
from engine.request import RequestOutput
from lora.adapter_info import AdapterInfo

PREFIX = "loragate_"
VLLM_PREFIX = "vllm:"
"""The same state under vLLM's names, for the routers that read those (see _vllm_names)."""
# Latency buckets in seconds: ITL on a GPU is a few ms, TTFT of a long RAG prompt on a CPU
# can be tens of seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
                    120.0)


class EngineCollector(Collector):
    """Engine gauges and counters from a stats snapshot function."""

    def __init__(self, stats: Callable[[], EngineStats],
                 adapters: Callable[[], list[AdapterInfo]], max_loras: int,
                 model_name: str = "") -> None:
        self._stats = stats
        self._adapters = adapters
        self._max_loras = max_loras
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield from (
            _gauge("num_requests_running", "Requests holding KV blocks and scheduled",
                   s.num_running),
            _gauge("num_requests_waiting", "Requests queued for admission", s.num_waiting),
            _gauge("num_requests_swapped", "Preempted requests whose KV is in swap space",
                   s.num_swapped),
            _gauge("kv_blocks_used", "KV blocks referenced by requests", s.kv_blocks_used),
            _gauge("kv_blocks_total", "KV blocks in the pool", s.kv_blocks_total),
            _gauge("kv_cache_usage_ratio", "Share of KV blocks in use",
                   s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0),
            _gauge("token_budget_utilization", "Scheduled tokens / max_num_batched_tokens of "
                   "the last step", s.token_budget_utilization),
            _gauge("token_budget_utilization_mean", "Mean token budget utilization per step",
                   s.mean_token_budget_utilization),
            _counter("preemptions", "Requests preempted", s.num_preemptions),
            _counter("prompt_tokens", "Prompt tokens of requests added", s.prompt_tokens),
            _counter("prompt_tokens_computed", "Prompt tokens run through the model "
                     "(prefix hits excluded, recomputation included)", s.prompt_tokens_computed),
            _counter("generation_tokens", "Tokens generated", s.generation_tokens),
            _counter("requests_finished", "Requests finished (any reason)",
                     s.num_requests_finished),
            _counter("engine_steps", "Scheduler steps run", s.num_steps),
        )
        p = s.prefix_cache
        yield from (
            _gauge("prefix_cache_enabled", "1 when the prefix cache looks up and inserts",
                   float(p.enabled)),
            _counter("prefix_cache_queries", "Prefix-cache lookups", p.queries),
            _counter("prefix_cache_query_tokens", "Prompt tokens looked up", p.query_tokens),
            _counter("prefix_cache_hit_tokens", "Prompt tokens served from the cache",
                     p.hit_tokens),
            _gauge("prefix_cache_hit_rate", "hit_tokens / query_tokens since start", p.hit_rate),
            _gauge("prefix_cache_rolling_hit_rate", "Hit rate over recent long prompts",
                   p.rolling_hit_rate),
            _gauge("prefix_cache_cached_blocks", "Blocks kept for reuse", p.cached_blocks),
            _counter("prefix_cache_evictions", "Cached blocks evicted", p.evictions),
        )
        yield from self._pools(s)
        infos = self._adapters()
        yield from self._lora(infos)
        yield from self._vllm_names(s, infos)

    def _vllm_names(self, s: EngineStats, infos: list[AdapterInfo]) -> Iterator[Metric]:
        """The series the Gateway API Inference Extension's endpoint picker (and llm-d, and
        vLLM dashboards) read, under vLLM's names: queue and running counts, KV usage as a
        fraction, and the LoRA state as one info gauge whose value is its timestamp (the
        picker keeps the newest). Its running_lora_adapters are the adapters holding a
        device slot, whether or not a request uses them now: what the picker's affinity
        means by "loaded" (vLLM lists only adapters with running requests)."""
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        for name, doc, value in (
                ("num_requests_waiting", "Requests waiting to be scheduled",
                 s.num_waiting + s.num_swapped),
                ("num_requests_running", "Requests scheduled", s.num_running),
                ("kv_cache_usage_perc", "KV cache usage (1 = full)", usage),
                ("gpu_cache_usage_perc", "KV cache usage (1 = full; vLLM's older name)", usage)):
            family = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family
        resident = sorted(i.name for i in infos if i.slot is not None)
        lora = GaugeMetricFamily(
            VLLM_PREFIX + "lora_requests_info", "Adapters on the device and those waited for "
            "(value: when this was read, unix seconds)",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric([str(self._max_loras), ",".join(resident),
                         ",".join(a for a in s.waiting_adapters if a not in resident)],
                        time.time())
        yield lora
        config = GaugeMetricFamily(VLLM_PREFIX + "cache_config_info", "KV cache layout",
                                   labels=["block_size", "num_gpu_blocks"])
        config.add_metric([str(s.block_size), str(s.kv_blocks_total)], 1.0)
        yield config

    def _pools(self, s: EngineStats) -> Iterator[Metric]:
        families = {
            "used": GaugeMetricFamily(PREFIX + "kv_pool_used_blocks",
                                      "KV blocks in use per pool", labels=["pool"]),
            "cached": GaugeMetricFamily(PREFIX + "kv_pool_cached_blocks",
                                        "Cached KV blocks per pool", labels=["pool"]),
            "floor": GaugeMetricFamily(PREFIX + "kv_pool_floor_blocks",
                                       "Reserved KV blocks per pool", labels=["pool"]),
            "cap": GaugeMetricFamily(PREFIX + "kv_pool_cap_blocks", "KV block cap per pool",
                                     labels=["pool"]),
            "hit_rate": GaugeMetricFamily(PREFIX + "kv_pool_hit_rate",
                                          "Prefix hit rate per pool", labels=["pool"]),
        }
        evictions = CounterMetricFamily(PREFIX + "kv_pool_evictions",
                                        "Cached blocks evicted per pool", labels=["pool"])
        hits = CounterMetricFamily(PREFIX + "kv_pool_hit_tokens",
                                   "Prompt tokens served from the cache per pool",
                                   labels=["pool"])
        for name, pool in s.kv_pools.items():
            families["used"].add_metric([name], pool.used_blocks)
            families["cached"].add_metric([name], pool.cached_blocks)
            families["floor"].add_metric([name], pool.floor_blocks)
            families["cap"].add_metric([name], pool.cap_blocks)
            families["hit_rate"].add_metric([name], pool.hit_rate)
            evictions.add_metric([name], pool.evictions)
            hits.add_metric([name], pool.hit_tokens)
        yield from families.values()
        yield evictions
        yield hits

    def _lora(self, infos: list[AdapterInfo]) -> Iterator[Metric]:
        yield _gauge("lora_max_slots", "max_loras: adapter slots on the device", self._max_loras)
        yield _gauge("lora_registered", "Adapters registered", len(infos))
        resident = GaugeMetricFamily(PREFIX + "lora_resident",
                                     "1 when the adapter holds a device slot",
                                     labels=["adapter"])
        running = GaugeMetricFamily(PREFIX + "lora_running_requests",
                                    "Running requests per adapter", labels=["adapter"])
        for info in infos:
            resident.add_metric([info.name], float(info.slot is not None))
            running.add_metric([info.name], info.running_requests)
        yield resident
        yield running


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class EngineMetricsRegistry:
    """The registry an engine exposes: the collector plus its latency histograms."""

    def __init__(self, collector: EngineCollector) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Arrival to first token", buckets=_LATENCY_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Gap between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Arrival to last token", buckets=_LATENCY_BUCKETS,
                             registry=self.registry)

    @classmethod
    def of(cls, engine: AsyncEngine) -> EngineMetricsRegistry:
        return cls(EngineCollector(engine.stats, lambda: engine.last_adapters,
                                   engine.config.max_loras, engine.model_name))

    def observe(self, out: RequestOutput) -> None:
        """Latencies of one output: TTFT with a request's first, the gaps of its new
        tokens, E2E with its last."""
        timing = out.timing
        new_tokens = len(out.delta_token_ids)
        if timing is None or timing.first_token is None:
            return
        itl = timing.inter_token_latencies
        if new_tokens and len(out.token_ids) == new_tokens:  # first output of the request
            self.ttft.observe(timing.first_token - timing.arrival)
            recent = itl
        else:
            recent = itl[-new_tokens:] if new_tokens else []
        for gap in recent:
            self.itl.observe(gap)
        if out.finished and timing.last_token is not None:
            self.e2e.observe(timing.last_token - timing.arrival)
