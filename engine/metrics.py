"""Engine counters and gauges, kept as plain numbers; the gateway exports them later."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefix_cache.pools import PoolStats


@dataclass(frozen=True)
class StepTiming:
    """Seconds one step spent in each phase."""

    schedule: float
    prepare: float
    forward: float
    sample: float
    output: float

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.output

    @property
    def outside_forward(self) -> float:
        return self.total - self.forward


_NOTHING_RETIRED = PoolStats(0, 0, 0, 0, 0, 0, 0, 0)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache figures: lookups happen once per admitted request. The counters are the
    pools' (prefix_cache.pools, their one owner); the global ones are their sums."""

    enabled: bool
    rolling_hit_rate: float
    """Over the last window of long prompts (drives prefix_caching="auto")."""
    cached_blocks: int
    """Blocks holding reusable KV under a hash, in use or free."""
    switches: int
    """Times "auto" turned caching off or on."""
    pools: dict[str, PoolStats]
    """Per adapter (and "base"): blocks used / cached, evictions, lookups, floor, cap."""
    retired: PoolStats = _NOTHING_RETIRED
    """What the pools of unloaded adapters counted (PoolAccounting.forget): still in the
    global counters, which never go down."""

    def _counted(self) -> list[PoolStats]:
        return [*self.pools.values(), self.retired]

    @property
    def queries(self) -> int:
        return sum(p.queries for p in self._counted())

    @property
    def query_tokens(self) -> int:
        return sum(p.query_tokens for p in self._counted())

    @property
    def hit_tokens(self) -> int:
        return sum(p.hit_tokens for p in self._counted())

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens since start."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def evictions(self) -> int:
        return sum(p.evictions for p in self._counted())


@dataclass(frozen=True)
class EngineStats:
    """A point-in-time copy of the engine's metrics."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks_used: int
    kv_blocks_total: int
    token_budget_utilization: float
    """Scheduled tokens / max_num_batched_tokens of the last step."""
    mean_token_budget_utilization: float
    num_preemptions: int
    prompt_tokens: int
    """Prompt tokens of all requests added."""
    prompt_tokens_computed: int
    """Tokens run through prefill (chunks), recomputation included."""
    generation_tokens: int
    num_steps: int
    num_requests_finished: int
    phase_seconds: dict[str, float]
    prefix_cache: PrefixCacheStats
    waiting_adapters: tuple[str, ...] = ()
    """Adapters of the requests waiting or swapped out (sorted, each once)."""
    block_size: int = 0

    @property
    def kv_pools(self) -> dict[str, PoolStats]:
        """Per adapter (and "base"): blocks used / cached, evictions, hit rate, floor, cap."""
        return self.prefix_cache.pools


@dataclass
class EngineMetrics:
    """Mutable counters updated by the step loop (one thread). Latencies are not here: the
    engine stamps each request's RequestTiming (LLMEngine._on_new_token), and whoever
    streams the outputs observes them."""

    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    num_requests_finished: int = 0
    last_budget_utilization: float = 0.0
    _utilization_sum: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("schedule", "prepare", "forward", "sample", "output"), 0.0))
    last_step: StepTiming | None = None

    def record_step(self, scheduled_tokens: int, prefill_tokens: int, budget: int,
                    timing: StepTiming) -> None:
        self.num_steps += 1
        self.prompt_tokens_computed += prefill_tokens
        self.last_budget_utilization = scheduled_tokens / budget
        self._utilization_sum += self.last_budget_utilization
        self.last_step = timing
        for name in self.phase_seconds:
            self.phase_seconds[name] += getattr(timing, name)

    @property
    def mean_budget_utilization(self) -> float:
        return self._utilization_sum / self.num_steps if self.num_steps else 0.0
