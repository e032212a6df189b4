"""GatewayConfig: the knobs of the HTTP gateway, frozen and validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from engine.http.auth import check_token

RoutingPolicyName = Literal["score", "round_robin"]
StoreFailurePolicy = Literal["open", "closed"]


@dataclass(frozen=True)
class GatewayConfig:
    """Configuration of one gateway process; see each field's comment for what it trades."""

    host: str = "127.0.0.1"
    """Address the gateway listens on."""
    port: int = 8000
    """Port the gateway listens on."""
    routing: RoutingPolicyName = "score"
    """"score": adapter residency, prefix overlap and load (see gateway/router.py);
    "round_robin": rotate over healthy instances (a baseline)."""
    max_in_flight_per_instance: int = 256
    """Admission bound: requests this gateway keeps in flight on one instance. When every
    healthy instance is at it, new requests get 429 with Retry-After."""
    retry_after_s: int = 1
    """Retry-After (seconds) sent with 429 and 503."""
    request_timeout_s: float = 600.0
    """A request still running after this many seconds is aborted (504 or a stream error)."""
    poll_interval_s: float = 0.5
    """How often every instance's /state (health, load, adapters, prefixes) is polled."""
    eject_after_failures: int = 2
    """Failed polls in a row that take an instance out of rotation."""
    max_attempts: int = 3
    """Instances one request may be tried on before its first token (retries on failure)."""
    startup_timeout_s: float = 300.0
    """How long serve waits for engine instances to become ready."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: how long in-flight requests may take to finish before exit."""
    served_model_name: str | None = None
    """Name of the base model in the API (default: the model directory's name)."""
    prefix_weight: float = 2.0
    """Router: weight of the matched-prefix fraction (0 ignores prefixes)."""
    load_weight: float = 1.0
    """Router: weight of load (in-flight / max_num_seqs + KV usage)."""
    imbalance: float = 0.5
    """Router: load gap beyond which an instance's prefix affinity stops counting."""
    routed_prefix_ttl_s: float = 20.0
    """Router: seconds a routed request's prompt counts as cached on its instance before
    that engine publishes it (a burst on a new document, a chat's quick next turn); 0 trusts
    only what engines published."""
    kv_events: bool = False
    """Follow the KV events of engines that publish them (their --kv-events-endpoint)
    block by block for prefix-aware routing, instead of the sparse hashes polled from their
    /state: evictions count at once. Engines without events are polled as before."""
    redis_url: str | None = None
    """Shared state (tenants, keys, adapters, rate-limit counters) in Redis, e.g.
    redis://127.0.0.1:6379/0, so several gateway replicas act as one; default: none (the
    state file, --state-path)."""
    state_path: str | None = None
    """Without --redis-url: the SQLite file that keeps tenants, keys and adapter records
    across restarts (default $LORAGATE_STATE_PATH, else $LORAGATE_HOME/state.db, i.e.
    ~/.cache/loragate/state.db); "" or ":memory:" keeps them in memory only. One gateway per
    file."""
    admin_key: str | None = field(default=None, repr=False)
    """Key of the admin API (/admin/...); without one the admin API is disabled."""
    allow_unauthenticated: bool = False
    """Allow the open mode (no tenants: no API keys needed) on a non-loopback address."""
    store_failure_policy: StoreFailurePolicy = "open"
    """When Redis is unreachable: "open" keeps serving with per-process limits, "closed"
    answers 503 until it is back."""
    priority_order: Literal["larger_first", "smaller_first"] = "larger_first"
    """How a request body's ``priority`` orders requests: larger first (loragate's), or
    smaller first (vLLM's, for clients written against it). Tenants' tiers always rank
    larger first."""
    tpm_unset_output_reserve: int = 1024
    """Tokens a request that sets no max_tokens (its output may fill the context) reserves
    of its tenant's TPM for its output, at most: reserving the whole context would lock a
    tenant out of its limit with one such request. What it uses beyond is charged when it
    ends: each such request in flight can take its tenant past the limit by up to the
    context less its prompt and this reserve (max_concurrency bounds how many)."""
    adapter_resolver_roots: tuple[str, ...] = ()
    """Opt-in, as vLLM's adapter resolvers: a request naming a model the gateway does not
    know loads ROOT/<name> (a PEFT directory, first root that has it) as a public adapter on
    first use. Engines must accept paths there (`serve` adds these roots to the engines it
    starts; remote engines need them in their --adapter-root)."""
    adapter_upload_dir: str | None = None
    """Where uploaded adapters are unpacked (default MODEL/uploaded-adapters); must be
    readable by the engines at the same path."""
    state_refresh_s: float = 0.5
    """How often the gateway checks the store for changed tenants, keys and adapters."""
    metrics_token: str | None = field(default=None, repr=False)
    """Bearer token that may read /metrics besides the admin key (for a Prometheus scraper
    that should not hold the admin key). /metrics and /instances need the admin key whenever
    an admin key is set or tenants exist; only the open mode leaves them open."""
    debug_headers: bool = False
    """Send x-loragate-route (the router's reason and every instance's score, engine URLs
    included) with each completion: for benchmarks and debugging on a trusted network."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names clients may address the gateway by (comma-separated; "*.example.com"
    matches subdomains, "*" any host). In open mode only loopback names are answered unless
    listed here (DNS rebinding: a web page must not reach a keyless gateway); with keys there
    is no Host check unless this is set."""
    header_read_timeout_s: float = 10.0
    """A connection must send a request's line and headers within this many seconds (from
    its opening, or the request's first byte); else it gets 408 and is closed."""
    max_header_bytes: int = 65536
    """Request line plus headers above this many bytes get 431 and the connection closed."""
    body_read_timeout_s: float = 30.0
    """A request body must arrive within this many seconds, plus one per MiB received (so
    large uploads are not cut off); else 408 and the connection is closed."""
    write_timeout_s: float = 60.0
    """A client that reads nothing of its response for this many seconds while output waits
    for it is dropped (the connection closed, its request aborted): it cannot hold a request
    and the output buffered for it open-ended."""
    engine_token: str | None = field(default=None, repr=False)
    """Shared secret the engines require (their --engine-token): sent to every engine, and
    the key that signs the Redis engine registry (discovery needs it). `serve` makes one up
    for the engines it starts when none is given."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.routing not in ("score", "round_robin"):
            raise ValueError(f"routing must be 'score' or 'round_robin', got {self.routing!r}")
        for name in ("max_in_flight_per_instance", "eject_after_failures", "max_attempts",
                     "tpm_unset_output_reserve"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.priority_order not in ("larger_first", "smaller_first"):
            raise ValueError(f"priority_order must be 'larger_first' or 'smaller_first', got "
                             f"{self.priority_order!r}")
        if self.store_failure_policy not in ("open", "closed"):
            raise ValueError(f"store_failure_policy must be 'open' or 'closed', got "
                             f"{self.store_failure_policy!r}")
        for name in ("request_timeout_s", "poll_interval_s", "startup_timeout_s",
                     "drain_timeout_s", "state_refresh_s", "header_read_timeout_s",
                     "body_read_timeout_s", "write_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:  # `not <` also refuses NaN
                raise ValueError(f"{name} must be a finite number > 0, got "
                                 f"{getattr(self, name)}")
        check_token(self.engine_token)  # its message never holds the value: a secret
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if not all(w >= 0 for w in (self.prefix_weight, self.load_weight, self.imbalance,
                                    self.routed_prefix_ttl_s)):
            raise ValueError("prefix_weight, load_weight, imbalance and routed_prefix_ttl_s "
                             "must be >= 0")
        if not isinstance(self.max_header_bytes, int) or self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be an integer >= 1024, got "
                             f"{self.max_header_bytes!r}")
        if self.metrics_token is not None and not self.metrics_token.strip():
            raise ValueError("metrics_token must not be empty")
        for host in self.allowed_hosts:
            pattern = host[2:] if host.startswith("*.") else "" if host == "*" else host
            if not host or "*" in pattern or any(c in host for c in " /@[]"):
                raise ValueError(f"allowed_hosts: {host!r} is not a host name, '*.domain' "
                                 f"or '*'")

    def upload_dir(self, model_dir: str) -> Path:
        """Where the admin API unpacks uploaded adapters for the model in ``model_dir``."""
        return Path(self.adapter_upload_dir or Path(model_dir) / "uploaded-adapters").resolve()
