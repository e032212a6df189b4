"""The gateway's request path below the HTTP routes: resolve the model, route, dispatch,
retry before the first token, time out, abort on disconnect, count.

Every request ends in exactly one of: a finished stream, an ApiError raised before anything
was sent (the route turns it into a 4xx/5xx), or a final error chunk in the stream.
Instances are EngineClients (engine/protocol.py): the engine in this process or engine
servers over HTTP, driven the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request

from engine.generation_defaults import SamplingDefaults
from engine.http.errors import CLIENT_CLOSED, ApiError
from engine.protocol import (
    ChunkStream,
    EngineError,
    EngineRejected,
    EngineStreamBroken,
    EngineUnavailable,
    StreamChunk,
)
from gateway.adapter_placement import AdapterPlacement
from gateway.auth import Principal, StateView, authenticate
from gateway.cache_key_affinity import CacheKeyAffinity
from gateway.config import GatewayConfig
from gateway.instances import Instance, InstancePool
from gateway.job import Claim, Job, Outcome, tier_share
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import RateLimiter
from gateway.route_inputs import candidates, note_prefix_outcome, prefix_chain
from gateway.router import Router
from gateway.store import Snapshot
from gateway.tenancy import AdapterRecord, derive_cache_salt

log = logging.getLogger(__name__)


class Gateway:
    """Dispatches jobs to engine instances through the router."""

    def __init__(self, config: GatewayConfig, pool: InstancePool, router: Router,
                 metrics: GatewayMetrics, base_model: str, view: StateView,
                 limiter: RateLimiter) -> None:
        self.config = config
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.base_model = base_model
        self.view = view
        self.limiter = limiter
        self.stopping = False
        """Set when the server ends what is still running at its drain deadline."""
        self._background: set[asyncio.Task[Any]] = set()
        self.usage: dict[str, tuple[int, int]] = {}
        """Per adapter ("base" for none): requests and tokens served by this gateway, under
        the adapter's current registration (see _forget_replaced_usage)."""
        self._registrations = {name: _registration(record)
                               for name, record in view.snapshot.adapters.items()}
        view.listeners.append(self._forget_replaced_usage)
        self.placement = AdapterPlacement(view, config.retry_after_s)
        self.resolver: Callable[[Gateway, str], Awaitable[bool]] | None = None
        """Loads an unknown model name as an adapter (opt-in; True when it did)."""
        self.cache_keys = CacheKeyAffinity()

    def cancelled_status(self) -> int:
        """The status a request whose work was cancelled counts as: 503 when the server
        cut it off at its drain deadline (``stopping``), else 499 (its client left)."""
        return 503 if self.stopping else CLIENT_CLOSED

    def _forget_replaced_usage(self, snapshot: Snapshot) -> None:
        """An adapter deleted or registered again (through any replica) starts its usage
        counts from zero."""
        registrations = {name: _registration(record)
                         for name, record in snapshot.adapters.items()}
        for name, registration in self._registrations.items():
            if registrations.get(name) != registration:
                self.usage.pop(name, None)
        self._registrations = registrations

    # ------------------------------------------------------------ who and what
    async def authenticate(self, request: Request) -> Principal:
        """The caller. A key this replica's view does not know yet (issued through another
        replica a moment ago) has the view caught up with the store before the 401 (every
        request of a burst with it waits for the same read: see StateView.fresh)."""
        try:
            return authenticate(request, self.view, self.config.admin_key)
        except ApiError as exc:
            if exc.status != 401:
                raise
        await self.view.fresh()
        return authenticate(request, self.view, self.config.admin_key)

    def adapter_names(self, principal: Principal) -> list[str]:
        return sorted(self.view.adapters_for(principal))

    async def resolve_or_load(self, model: str, principal: Principal) -> str | None:
        """resolve_model, after loading an unknown name through the adapter resolver
        (gateway/adapter_resolver.py) when one is configured."""
        try:
            return self.resolve_model(model, principal)
        except ApiError as exc:
            if exc.status != 404 or self.resolver is None or \
                    not await self.resolver(self, model):
                raise
        return self.resolve_model(model, principal)

    def resolve_model(self, model: str, principal: Principal) -> str | None:
        """The adapter a `model` field names (None: the base model); 404 if unknown or not
        visible to the caller (never 403: a tenant must not learn what others have)."""
        if model == self.base_model:
            return None
        if model in self.view.adapters_for(principal):
            return model
        raise ApiError(404, f"The model '{model}' does not exist", code="model_not_found",
                       param="model")

    def cache_salt(self, principal: Principal, requested: str | None) -> str | None:
        """A tenant's salt always leads, length-prefixed, so no request can reach another
        tenant's blocks (tenancy.derive_cache_salt)."""
        tenant = principal.tenant
        return derive_cache_salt(tenant.cache_salt if tenant else None, requested)

    def priority(self, principal: Principal, requested: int) -> int:
        """The tenant's tier sets the priority; the body's priority only orders requests
        within a tier (the open mode takes it as is). Larger runs first, unless the gateway
        takes vLLM's order (priority_order "smaller_first"), where the body's is negated."""
        if self.config.priority_order == "smaller_first":
            requested = -requested
        if principal.tenant is None:
            return requested
        # Tiers 2000 apart hold the body's whole [-999, 999]: a tier always outranks the
        # tiers below it, whatever priorities their requests ask for.
        return principal.tenant.priority * 2000 + max(-999, min(999, requested))

    async def admit(self, principal: Principal) -> tuple[Principal, Claim]:
        """The caller as of its arrival, and its claim. First the view catches up with the
        store, so the tenant's record (limits, tier, shared salt) and the adapters it may
        use are as of this request's arrival, whichever replica changed them: a salt no
        longer shared reaches no other tenant's blocks from the next request on. Then the
        tenant's limits (RPM, concurrency, a revoked key) are checked, before any expensive
        work, so even a request refused later counts; 429 / 401 / 503 when refused here.
        The two store reads run one after the other: the limits checked must be the
        record's current ones."""
        await self.view.fresh()
        principal = self.view.current(principal)
        ticket = await self.limiter.admit(principal)
        return principal, Claim(ticket, tier_share(principal))

    def settle(self, claim: Claim, tokens: int, outcome: Outcome,
               adapter: str | None = None) -> None:
        """End the claim once (later calls do nothing): see Outcome. A served request also
        counts in its adapter's usage."""
        if claim.settled:
            return
        claim.settled = True
        if outcome == "served":
            name = adapter or "base"
            requests, served = self.usage.get(name, (0, 0))
            self.usage[name] = (requests + 1, served + tokens)
        ticket, claim.ticket = claim.ticket, None
        if ticket is None:
            return
        # A refused request stays counted, as if it had reached an engine and used nothing.
        self._later(self.limiter.release(ticket, tokens if outcome == "served" else 0,
                                         outcome != "failed"))

    def max_model_len(self) -> int:
        lengths = [i.max_model_len for i in self.pool.healthy() if i.max_model_len]
        return min(lengths) if lengths else 0

    def context_length(self) -> int:
        """max_model_len of the ready instances; the same 503 routing gives when none is
        ready (asked before tokenizing: no point in the work when nothing can serve)."""
        context = self.max_model_len()
        if not context:
            raise self._no_instance()
        return context

    def _no_instance(self) -> ApiError:
        return ApiError(503, "no engine instance is ready; retry later", code="unavailable",
                        headers={"Retry-After": str(self.config.retry_after_s)})

    def sampling_defaults(self) -> SamplingDefaults:
        """The model's recommended sampling as a ready instance reports it (every instance
        serves the same model; none ready: OpenAI's defaults)."""
        ready = self.pool.healthy()
        return ready[0].sampling_defaults if ready else SamplingDefaults()

    def max_request_tokens(self) -> int:
        """Prompt + output every healthy instance can hold (the default output budget)."""
        sizes = [i.max_request_tokens for i in self.pool.healthy() if i.max_request_tokens]
        return min(sizes) if sizes else 0

    # ---------------------------------------------------------------- routing
    def _route(self, job: Job, tried: set[str]) -> Instance:
        instances = [i for i in self.pool.healthy() if i.instance_id not in tried]
        if not instances:
            raise self._no_instance()
        chain = prefix_chain(self.pool, self.config, job)
        prompt_len = len(job.request.prompt_token_ids)
        same = [i for i in instances if i.instance_id == job.prefer]
        decision = self.router.choose(candidates(self.pool, self.config, job, same, chain),
                                      job.adapter, prompt_len) if same else None
        if decision is None:  # no preference, or that instance is gone or full
            decision = self.router.choose(
                candidates(self.pool, self.config, job, instances, chain,
                           self.cache_keys.instance_for(job.cache_key)), job.adapter,
                prompt_len)
        if decision is None:
            raise ApiError(429, "every engine instance is at its admission limit; retry "
                           "later", code="overloaded",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        self.metrics.routing.labels(decision.reason).inc()
        self.cache_keys.note(job.cache_key, decision.instance_id)
        if chain is not None and self.pool.index is not None:
            self.pool.index.note_routed(decision.instance_id, chain)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s: %s", job.request_id, decision.explain())
        job.decision = decision
        return self.pool.instances[decision.instance_id]

    # --------------------------------------------------------------- dispatch
    async def open(self, job: Job) -> ChunkStream:
        """Send the job to an instance that takes it (ApiError when none does: nothing was
        generated anywhere) and return its chunks. From then on a failure before the first
        token retries elsewhere, and any other failure is a final error chunk."""
        tried: set[str] = set()
        instance, stream = await self._dispatch(job, tried)
        self.metrics.queue_time.observe(time.monotonic() - job.arrival)

        def never_read() -> None:
            instance.release(job.adapter)
            self._later(stream.aclose())

        return ChunkStream(self._relay(job, tried, instance, stream), never_read)

    async def _dispatch(self, job: Job, tried: set[str]) -> tuple[Instance, ChunkStream]:
        """Route and open until an instance accepts (its in_flight counts the job)."""
        while len(tried) < self.config.max_attempts:
            instance = self._route(job, tried)
            tried.add(instance.instance_id)
            job.instance_id = instance.instance_id
            instance.take(job.adapter)
            try:
                async with instance.watched(self._deadline(job)):
                    return instance, await self.placement.open_on(instance, job)
            except EngineUnavailable as exc:
                instance.release(job.adapter)
                # A frozen engine may run it when it wakes: nobody would read it.
                self._later(instance.client.abort(job.request_id))
                self.pool.mark_failed(instance, exc)
                self.metrics.retries.labels(type(exc).__name__).inc()
                log.warning("retrying %s elsewhere: %s", job.request_id, exc)
            except BaseException as exc:
                instance.release(job.adapter)
                if isinstance(exc, TimeoutError):
                    self._later(instance.client.abort(job.request_id))
                    raise ApiError(504, self._timeout_message(), code="timeout") from None
                if isinstance(exc, EngineRejected):
                    raise ApiError.of(exc) from None
                raise
        message = f"no engine instance could take the request after {len(tried)} attempt(s)"
        raise ApiError(503, message, code="unavailable",
                       headers={"Retry-After": str(self.config.retry_after_s)})

    async def _relay(self, job: Job, tried: set[str], instance: Instance,
                     stream: ChunkStream) -> AsyncGenerator[StreamChunk, None]:
        """The chunks of an accepted job, retried elsewhere while none carried a token to
        the client (a whole-response job's chunks reach it only at the end: see Job.whole)."""
        tokens_sent = False
        held: list[StreamChunk] = []
        while True:
            try:
                async with contextlib.aclosing(stream):
                    while True:
                        chunk = await self._next_chunk(job, instance, stream)
                        error = chunk.error
                        if error is not None:
                            log.warning("%s failed on %s: %s", job.request_id,
                                        instance.instance_id, error.message)
                            if error.code == "timeout":  # the engine saw the deadline
                                chunk = self._failed(job, self._timeout_message(), "timeout")
                            elif error.code == "shutting_down" and not tokens_sent:
                                # Its engine stopped before it finished (a drain past its
                                # deadline): nothing reached the client, so another takes it.
                                raise EngineUnavailable(error.message, "shutting_down")
                        if job.whole and not chunk.finished:
                            if chunk.delta_token_ids and job.first_token_at is None:
                                job.first_token_at = time.monotonic()
                            job.held_tokens += len(chunk.delta_token_ids)
                            held.append(chunk)
                            continue
                        for earlier in held:
                            yield earlier
                        tokens_sent = tokens_sent or bool(chunk.delta_token_ids)
                        if chunk.finished:
                            note_prefix_outcome(self.pool, self.metrics, job, chunk)
                        yield chunk
                        if chunk.finished:
                            return
            except StopAsyncIteration:
                return
            except (EngineUnavailable, EngineStreamBroken) as exc:
                self.pool.mark_failed(instance, exc)
                if tokens_sent:  # the detail (engine URL) is logged, not sent
                    log.warning("%s broke mid-response on %s: %s", job.request_id,
                                instance.instance_id, exc)
                    yield self._failed(job, "the engine instance failed mid-response")
                    return
                self.metrics.retries.labels(type(exc).__name__).inc()
                log.warning("retrying %s elsewhere: %s", job.request_id, exc)
                held.clear()  # a whole response starts over: nothing of it was sent
                job.first_token_at, job.held_tokens = None, 0
            except TimeoutError:
                self._later(instance.client.abort(job.request_id))
                yield self._failed(job, self._timeout_message(), "timeout")
                return
            except (asyncio.CancelledError, GeneratorExit):
                # Client gone: closing the stream already aborts on the engine; the explicit
                # abort covers an HTTP connection that lingers in the pool.
                self._later(instance.client.abort(job.request_id))
                raise
            finally:
                instance.release(job.adapter)
            try:
                instance, stream = await self._dispatch(job, tried)
            except ApiError as exc:
                yield self._failed(job, exc.message, exc.code or "unavailable")
                return

    async def _next_chunk(self, job: Job, instance: Instance, stream: ChunkStream
                          ) -> StreamChunk:
        """The stream's next chunk: TimeoutError past the job's deadline, EngineUnavailable
        when the instance is ejected as frozen meanwhile (Instance.watched)."""
        # A timeout scope around the await only (no task per chunk, unlike wait_for on
        # 3.11); the loop clock is time.monotonic.
        async with instance.watched(self._deadline(job)):
            return await anext(stream)

    def _deadline(self, job: Job) -> float:
        return job.arrival + self.config.request_timeout_s

    def _timeout_message(self) -> str:
        return f"request timed out after {self.config.request_timeout_s:g}s"

    def _failed(self, job: Job, message: str, code: str = "engine_error") -> StreamChunk:
        """A final chunk with an error (logged: the client is told only in its stream)."""
        log.warning("%s failed: %s (%s)", job.request_id, message, code)
        return StreamChunk.failed(job.request_id, EngineError(message, code),
                                  len(job.request.prompt_token_ids))

    def _later(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run best-effort work (an abort, closing a stream, releasing a rate-limit ticket) in
        the background; a failure (the instance or the store is gone) is logged, never
        raised."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(_cleanup_done)
        task.add_done_callback(self._background.discard)


def _cleanup_done(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background work failed: %r", task.exception())


def _registration(record: AdapterRecord) -> tuple[str, str | None, str | None]:
    """What makes a registration the same adapter: its files (an owner or ACL change keeps
    it)."""
    return record.path, record.digest, record.upload_id
