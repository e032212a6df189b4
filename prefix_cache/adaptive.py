"""The "auto" switch that turns prefix caching off when it does not pay, from a rolling hit
rate over long prompts. The lookup counters themselves live in prefix_cache.pools."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

PrefixCachingMode = Literal["on", "off", "auto"]


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of prefix_caching="auto"."""

    threshold: float = 0.30
    """Rolling hit rate (tokens) on long prompts under which caching is switched off."""
    window: int = 64
    """Long-prompt lookups in the rolling window; the switch decides only on a full window."""
    long_prompt_tokens: int = 256
    """Prompts shorter than this do not count: their hit rate says little about RAG reuse."""
    probe_every: int = 512
    """Admitted requests between probes while switched off; a probe switches caching on for
    one new window and decides again."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        for name in ("window", "long_prompt_tokens", "probe_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class HitRateTracker:
    """A rolling window of (query tokens, hit tokens) on long prompts, which drives the auto
    switch."""

    def __init__(self, mode: PrefixCachingMode, config: AdaptiveConfig | None = None) -> None:
        if mode not in ("on", "off", "auto"):
            raise ValueError(f"prefix_caching must be 'on', 'off' or 'auto', got {mode!r}")
        self.mode = mode
        self.config = config or AdaptiveConfig()
        self.enabled = mode != "off"
        self.num_switches = 0
        self._window: deque[tuple[int, int]] = deque(maxlen=self.config.window)
        self._since_off = 0

    @property
    def rolling_hit_rate(self) -> float:
        queried = sum(q for q, _ in self._window)
        return sum(h for _, h in self._window) / queried if queried else 0.0

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """One lookup (made only while enabled)."""
        if query_tokens >= self.config.long_prompt_tokens:
            self._window.append((query_tokens, hit_tokens))
            self._decide()

    def on_admitted(self) -> None:
        """Count an admitted request while switched off; probe after probe_every of them."""
        if self.mode != "auto" or self.enabled:
            return
        self._since_off += 1
        if self._since_off >= self.config.probe_every:
            self.enabled = True
            self.num_switches += 1
            self._window.clear()

    def _decide(self) -> None:
        if self.mode != "auto" or len(self._window) < self.config.window:
            return
        if self.rolling_hit_rate < self.config.threshold:
            self.enabled = False
            self.num_switches += 1
            self._since_off = 0
            self._window.clear()
