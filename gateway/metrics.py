"""Prometheus metrics of the gateway (its own registry, so tests can run several apps)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.instances import InstancePool

PREFIX = "loragate_gateway_"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                    10.0, 30.0, 60.0, 120.0)


class _InstanceCollector(Collector):
    """Per-instance health, in-flight requests and load, read at scrape time."""

    def __init__(self, pool: Callable[[], InstancePool | None]) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(PREFIX + "instance_healthy",
                                    "1 when the instance gets traffic", labels=["instance"])
        in_flight = GaugeMetricFamily(PREFIX + "instance_in_flight",
                                      "Requests this gateway has in flight on the instance",
                                      labels=["instance"])
        waiting = GaugeMetricFamily(PREFIX + "instance_waiting",
                                    "Waiting requests the instance last reported",
                                    labels=["instance"])
        kv = GaugeMetricFamily(PREFIX + "instance_kv_usage",
                               "KV usage the instance last reported", labels=["instance"])
        pool = self._pool()
        routable = {i.instance_id for i in pool.healthy()} if pool else set()
        for instance in (pool.instances.values() if pool else ()):
            # What routing sees (InstancePool.healthy): a silent instance is out at once.
            healthy.add_metric([instance.instance_id], float(instance.instance_id in routable))
            in_flight.add_metric([instance.instance_id], instance.in_flight)
            waiting.add_metric([instance.instance_id], instance.num_waiting)
            kv.add_metric([instance.instance_id], instance.kv_usage)
        yield from (healthy, in_flight, waiting, kv)


class GatewayMetrics:
    """Counters and histograms the request path updates."""

    def __init__(self, pool: Callable[[], InstancePool | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_InstanceCollector(pool))
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "Requests by final HTTP status",
                                ["endpoint", "status", "adapter", "instance"], registry=r)
        self.responses = Counter(
            PREFIX + "responses", "Every HTTP response by route template, status and error "
            "code (refusals before any work included; 499: the client left first)",
            ["route", "status", "code"], registry=r)
        self.routing = Counter(PREFIX + "routing_decisions", "Routing decisions by reason",
                               ["reason"], registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests re-sent to another instance "
                               "before their first token", ["reason"], registry=r)
        self.queue_time = Histogram(PREFIX + "queue_time_seconds",
                                    "Arrival until an instance accepted the request",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Arrival until the first token left the gateway",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Gap between streamed chunks of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Arrival until the last token", buckets=_LATENCY_BUCKETS,
                             registry=r)
        # How well the prefix index tracks the engines' caches (polled or fed by KV
        # events): what routing credited against what the engine then read from its cache.
        self.prefix_credited = Counter(
            PREFIX + "routed_prefix_credited_tokens", "Prompt tokens the router believed "
            "the chosen instance held cached (capped as an engine caps a hit)", registry=r)
        self.prefix_found = Counter(
            PREFIX + "routed_prefix_found_tokens", "Credited prompt tokens the instance "
            "did read from its cache", registry=r)
        self.prefix_cached = Counter(
            PREFIX + "routed_cached_tokens", "Prompt tokens the chosen instances read from "
            "their caches, credited or not", registry=r)
        self.stale_routes = Counter(
            PREFIX + "stale_routes", "Requests whose instance held less of the prompt than "
            "the router credited it with (evicted, or never cached)", registry=r)
