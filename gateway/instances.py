"""The engine instances a gateway routes to: health, ejection, state and the prefix index.

A background task polls every instance's state (one call carries health, load, resident
adapters and the prefix hashes published since the last poll: engine/protocol.py
EngineState). An instance is any EngineClient: an engine server over HTTP, or the engine in
this process (gateway/local_engine.py). An instance that fails
``eject_after`` polls in a row, or whose connection fails under a request, is ejected: it
gets no traffic and its prefix entries are dropped, until a poll succeeds again. When an
instance comes (back) up, every adapter the gateway knows is registered on it, so any
instance can serve any adapter; which ones are resident in its slots is the router's affair.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from engine.generation_defaults import SamplingDefaults
from engine.protocol import (
    EngineClient,
    EngineRejected,
    EngineState,
    EngineUnavailable,
    LoadedAdapter,
    PoolSummary,
)
from gateway.engine_client import HttpEngineClient
from gateway.kv_events_subscriber import KVEventSubscriber, reachable
from lora.adapter_info import AdapterInfo
from prefix_cache.index import PrefixIndex

log = logging.getLogger(__name__)


@dataclass
class Instance:
    """What the gateway knows of one engine instance."""

    instance_id: str
    client: EngineClient
    healthy: bool = False
    draining: bool = False
    consecutive_failures: int = 0
    in_flight: int = 0
    """Requests this gateway sent and that have not ended (its own admission count)."""
    routed_adapters: Counter[str] = field(default_factory=Counter)
    """Of those, how many use each adapter: each such adapter holds or awaits a slot there
    from the moment it is sent, while the polled residency shows it only a poll later."""
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    max_loras: int = 0
    max_lora_rank: int = 0
    """The largest adapter rank it loads (0: not reported yet)."""
    max_num_seqs: int = 1
    max_model_len: int = 0
    max_request_tokens: int = 0
    """Prompt + output one request can hold there (context, or KV capacity if smaller)."""
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    """The model's recommended sampling, for fields a request leaves unset."""
    block_size: int = 16
    publish_every: int = 4
    prefix_hit_rate: float = 0.0
    adapters: dict[str, AdapterInfo] = field(default_factory=dict)
    kv_pools: dict[str, PoolSummary] = field(default_factory=dict)
    """Per pool (adapter name or "base")."""
    last_ok: float = 0.0
    waits: dict[asyncio.Timeout, float] = field(default_factory=dict)
    """The timeout scopes of this gateway's waits on the instance now pending (opening a
    request, loading its adapter, reading its stream), each with the loop time it began:
    a frozen engine answers nothing, not even an error, so ejecting it ends them."""
    silent_since: float | None = None
    """Loop time the first of the state calls in a row that timed out began (None: the
    last one answered or failed otherwise)."""
    busy: bool = False
    """Its last state call timed out while /health answered: a step longer than the poll
    timeout, not a frozen engine (it keeps its requests and its last state)."""
    _ended: set[asyncio.Timeout] = field(default_factory=set, repr=False)
    """Scopes end_waits ended (their TimeoutError means "ejected", not a deadline)."""

    def note_loaded(self, path: str, loaded: LoadedAdapter) -> None:
        """This gateway just loaded an adapter there: known at once (an admin answer or the
        next request sees it) rather than at the next poll, which brings its slot and use."""
        self.adapters[loaded.name] = AdapterInfo(loaded.name, path, loaded.digest, loaded.rank,
                                                 True, None, False, 0)

    def note_unloaded(self, name: str, digest: str | None = None) -> None:
        """This gateway just unloaded ``name`` there (only the weights of ``digest``)."""
        state = self.adapters.get(name)
        if state is not None and digest in (None, state.digest):
            del self.adapters[name]

    @contextlib.asynccontextmanager
    async def watched(self, deadline: float) -> AsyncIterator[None]:
        """Wait on the instance until ``deadline`` (loop time): TimeoutError past it, and
        EngineUnavailable when end_waits ends the wait earlier."""
        loop = asyncio.get_running_loop()
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                self.waits[scope] = loop.time()
                try:
                    yield
                finally:
                    self.waits.pop(scope, None)
        except TimeoutError:
            if scope not in self._ended:
                raise  # the deadline, or a timeout of the awaited work's own
            raise EngineUnavailable(f"instance {self.instance_id} stopped answering and was "
                                    f"ejected") from None
        finally:
            self._ended.discard(scope)

    def end_waits(self, began_before: float) -> None:
        """Every wait pending since before ``began_before`` (loop time) ends now (see
        watched). Called on ejection of an instance judged frozen (its state calls timed
        out in a row and /health did not answer either) with the present: a wait that
        began after it fell silent has had nothing from it either, and would otherwise sit
        out its request's deadline (600 s) on an instance no longer polled as one that
        serves. Only for an instance that stopped answering: one whose connections fail
        ends its streams itself (cancelling reads that are handling that failure would race
        with it), and a draining one finishes them."""
        now = asyncio.get_running_loop().time()
        for scope, began in list(self.waits.items()):
            # A scope whose own deadline fired this loop turn is expiring already
            # (reschedule would refuse it): it ends by itself.
            if began < began_before and not scope.expired():
                self._ended.add(scope)
                scope.reschedule(now)

    def take(self, adapter: str | None) -> None:
        """A request of this gateway (on ``adapter``, None: the base model) was sent there."""
        self.in_flight += 1
        if adapter is not None:
            self.routed_adapters[adapter] += 1

    def release(self, adapter: str | None) -> None:
        """A request ``take`` counted has ended there (or was never opened)."""
        self.in_flight -= 1
        if adapter is not None:
            self.routed_adapters[adapter] -= 1
            if self.routed_adapters[adapter] <= 0:
                del self.routed_adapters[adapter]

    @property
    def slot_claims(self) -> frozenset[str]:
        """Adapters that hold a slot there or will take one: resident at the last poll, or
        used by a request this gateway sent since (what the router counts against
        max_loras: a burst of new adapters must not all see the same free slots)."""
        return self.resident | self.routed_adapters.keys()

    @property
    def unevictable(self) -> frozenset[str]:
        """Adapters whose slot cannot be taken now: busy at the last poll, or used by a
        request of this gateway that has not ended."""
        return self.busy_adapters | self.routed_adapters.keys()

    @property
    def resident(self) -> frozenset[str]:
        return frozenset(a.name for a in self.adapters.values() if a.slot is not None)

    @property
    def busy_adapters(self) -> frozenset[str]:
        """Resident adapters that cannot be evicted now (requests running, or pinned)."""
        return frozenset(a.name for a in self.adapters.values()
                         if a.slot is not None and (a.running_requests or a.pinned))


class InstancePool:
    """Engine instances, kept current by poll()."""

    def __init__(self, urls: list[str], http: aiohttp.ClientSession, eject_after: int = 2,
                 adapters: dict[str, str] | None = None, routed_prefix_ttl_s: float = 20.0,
                 engine_token: str | None = None,
                 local: dict[str, EngineClient] | None = None,
                 control_http: aiohttp.ClientSession | None = None) -> None:
        self._http = http
        self._control_http = control_http
        self._engine_token = engine_token
        self.instances: dict[str, Instance] = {
            instance_id: Instance(instance_id, client)
            for instance_id, client in (local or {}).items()}
        """By instance id: an engine server's URL, or a local engine's name."""
        for url in urls:
            self.add_instance(url)
        self.eject_after = eject_after
        self.adapter_paths: dict[str, str] = dict(adapters or {})
        """Adapters registered on every instance: name -> PEFT directory (on the engines'
        filesystem)."""
        self.index: PrefixIndex | None = None
        self.routed_prefix_ttl_s = routed_prefix_ttl_s
        self._registered: dict[str, set[str]] = {}
        self.kv_events = False
        """Follow the KV events of engines that publish them (gateway/kv_events_subscriber)
        instead of their polled prefix hashes."""
        self._subscribers: dict[str, KVEventSubscriber] = {}

    def add_instance(self, url: str) -> Instance:
        """Start tracking an engine (healthy after its first successful poll)."""
        url = url.rstrip("/")
        if url not in self.instances:
            self.instances[url] = Instance(url, HttpEngineClient(
                url, self._http, token=self._engine_token, control=self._control_http))
        return self.instances[url]

    def remove_instance(self, url: str) -> None:
        instance = self.instances.pop(url.rstrip("/"), None)
        if instance is not None:
            self._forget(instance)

    def healthy(self) -> list[Instance]:
        """The instances new requests may go to: up, not draining, and not silent (its last
        state call timed out and /health did not answer either: frozen, most likely, and
        ejected if the next poll finds it so; no new request waits on it meanwhile)."""
        return [i for i in self.instances.values()
                if i.healthy and not i.draining and i.silent_since is None]

    def digest_of(self, adapter: str) -> str | None:
        """The adapter's content digest as any instance reports it."""
        for instance in self.instances.values():
            state = instance.adapters.get(adapter)
            if state is not None:
                return state.digest
        return None

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll_one(i) for i in self.instances.values()))

    async def run(self, interval_s: float) -> None:
        """Poll forever (the app runs this as a background task)."""
        while True:
            try:
                await self.poll()
            except Exception:  # never let the poller die: routing would freeze
                log.exception("instance poll failed")
            await asyncio.sleep(interval_s)

    def mark_failed(self, instance: Instance, failure: Exception) -> None:
        """A request could not reach the instance: eject it now rather than at next poll,
        unless the failure was a timeout: a busy engine can be slow to take a connection,
        and the next poll tells busy from frozen (alive())."""
        if _frozen(failure):
            log.warning("%s did not answer in time: %s", instance.instance_id, failure)
            return
        if instance.healthy:
            log.warning("ejecting %s: %s", instance.instance_id, failure)
        instance.healthy = False
        instance.consecutive_failures = max(instance.consecutive_failures, self.eject_after)
        self._forget(instance)

    async def _poll_one(self, instance: Instance) -> None:
        began = asyncio.get_running_loop().time()
        try:
            cursor = self.index.cursor(instance.instance_id) if self.index else 0
            state = await instance.client.state(cursor)
        except EngineUnavailable as exc:
            if _frozen(exc) and await instance.client.alive():
                # Busy, not frozen: a step longer than the poll timeout (a long prefill,
                # prompt logprobs on a loaded host). Its streams move; its last state stands.
                if not instance.busy:
                    log.info("%s is busy: its state call timed out, /health answers",
                             instance.instance_id)
                instance.busy = True
                instance.silent_since = None
                return
            if not _frozen(exc):
                instance.silent_since = None
            elif instance.silent_since is None:
                instance.silent_since = began
            if instance.silent_since is not None:
                # Frozen (neither the state call nor /health answered): the waits that began
                # before this poll have had nothing from it either. They end now, retried
                # elsewhere before a first token, not at the ejection a poll or more later.
                instance.end_waits(began)
            instance.consecutive_failures += 1
            if instance.consecutive_failures < self.eject_after:
                return
            if instance.healthy or instance.draining:  # a drained engine that exited too
                log.warning("ejecting %s after %d failed polls: %s", instance.instance_id,
                            instance.consecutive_failures, exc)
                instance.healthy = instance.draining = False
                self._forget(instance)
            if instance.silent_since is not None:  # frozen: nothing of it moves
                instance.end_waits(asyncio.get_running_loop().time())
            return
        instance.silent_since = None
        instance.busy = False
        was_healthy = instance.healthy
        self._apply_state(instance, state)
        if not was_healthy and not instance.draining:  # a draining one is not coming up
            await self._register_adapters(instance)
            log.info("instance %s is up", instance.instance_id)
        instance.healthy = not instance.draining
        instance.consecutive_failures = 0
        instance.last_ok = time.monotonic()

    def _apply_state(self, instance: Instance, state: EngineState) -> None:
        instance.draining = state.draining
        instance.num_running = state.num_running
        instance.num_waiting = state.num_waiting
        instance.kv_usage = state.kv_blocks_used / (state.kv_blocks_total or 1)
        instance.max_loras = state.max_loras
        instance.max_lora_rank = state.max_lora_rank
        instance.max_num_seqs = state.max_num_seqs
        instance.max_model_len = state.max_model_len
        instance.max_request_tokens = state.max_request_tokens
        instance.sampling_defaults = state.sampling_defaults
        instance.block_size = state.block_size
        instance.publish_every = state.publish_every
        instance.prefix_hit_rate = state.prefix_hit_rate
        instance.kv_pools = state.kv_pools
        instance.adapters = {a.name: a for a in state.adapters}
        if self.index is None:
            self.index = PrefixIndex(instance.block_size, instance.publish_every,
                                     self.routed_prefix_ttl_s)
        self.index.apply(instance.instance_id, state.prefix)  # keeps the cursor too
        if self.kv_events and state.kv_events and instance.instance_id not in self._subscribers:
            endpoint, replay = state.kv_events
            url = instance.instance_id if "://" in instance.instance_id else None
            self._subscribers[instance.instance_id] = KVEventSubscriber(
                instance.instance_id, reachable(endpoint, url),
                None if replay is None else reachable(replay, url), self._on_kv_events,
                asyncio.get_running_loop())

    def _on_kv_events(self, engine_id: str, stored: list[int], removed: list[int],
                      cleared: bool) -> None:
        if self.index is not None and engine_id in self._subscribers:
            self.index.apply_events(engine_id, stored, removed, cleared)

    def prefix_source(self, instance_id: str) -> str:
        """Where the index learns what the instance caches: "kv_events" or "poll"."""
        following = self.index is not None and self.index.follows_events(instance_id)
        return "kv_events" if following else "poll"

    def close(self) -> None:
        """Stop following KV events."""
        for subscriber in self._subscribers.values():
            subscriber.stop()
        self._subscribers.clear()

    def _forget(self, instance: Instance) -> None:
        """Drop what a dead instance had published: a restarted engine starts empty."""
        subscriber = self._subscribers.pop(instance.instance_id, None)
        if subscriber is not None:  # a restarted engine numbers its events from 0 again
            subscriber.stop()
        if self.index is not None:
            self.index.remove_engine(instance.instance_id)

    async def _register_adapters(self, instance: Instance) -> None:
        for name, path in self.adapter_paths.items():
            if name in instance.adapters:
                continue
            try:
                await instance.client.load_adapter(name, path)
            except (EngineRejected, EngineUnavailable) as exc:
                log.error("instance %s refused adapter %s (%s): %s", instance.instance_id,
                          name, path, exc)


def _frozen(failure: Exception) -> bool:
    """The state call timed out: the engine (or its host) stopped answering, frozen (stopped,
    swapping, wedged) or cut off, so its streams will not move either; control calls have
    their own connections (HttpEngineClient), so this is never a wait for one behind
    streams. One that refuses connections is draining (its streams still finish) or dead
    (they broke)."""
    return isinstance(failure.__cause__, TimeoutError)
