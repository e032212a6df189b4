"""The gateway's FastAPI app: OpenAI routes, health, metrics, instance view.

    GET  /health        200 while at least one instance is ready and the gateway is not
                        draining, else 503 (also GET/POST /ping, vLLM's name for it)
    GET  /version       {"version": the installed loragate's}
    GET  /metrics       Prometheus (gateway series, and an in-process engine's); the admin
                        key or the metrics token
    GET  /instances     what the router sees of every instance (debugging, benchmarks); the
                        admin key
    /v1/...             see gateway/openai_api.py

/metrics and /instances are open only in the open mode (gateway/exposure.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Scope
from transformers import AutoTokenizer

from engine.http.draining import stop_background
from engine.http.errors import ERROR_CODE_KEY, ApiError, answer, install_error_handlers
from engine.models.loader import load_hf_config
from engine.models.shape import ModelShape
from gateway.access_log import AccessLog
from gateway.adapter_admin import PendingDeletes
from gateway.adapter_resolver import AdapterResolver
from gateway.admin_api import build_admin_router
from gateway.auth import StateView, require_admin
from gateway.config import GatewayConfig
from gateway.configured_adapters import bring_to_command_line
from gateway.demo_adapters import watch
from gateway.docs_ui import install_docs
from gateway.exposure import instance_tag, operator_endpoints_open, require_operator
from gateway.guard import Guard
from gateway.instances import InstancePool
from gateway.local_engine import LocalEngine
from gateway.metrics import GatewayMetrics
from gateway.openai_api import build_router
from gateway.ratelimit import RateLimiter
from gateway.redact import redact_url
from gateway.redis_store import RedisStore, check_reachable
from gateway.registry import discover
from gateway.route_label import UNMATCHED, RouteLabels
from gateway.router import Router, RouterWeights
from gateway.service import Gateway
from gateway.shutdown_cutoff import ShutdownCutoff
from gateway.sqlite_store import SqliteStore, resolve_state_path
from gateway.store import MemoryStore, StateStore, StoreUnavailable
from gateway.tenancy import AdapterRecord
from gateway.vllm_adapter_api import VLLM_ADMIN_PATHS
from lora.demo_data import STYLES

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20
"""Request bodies above this are refused with 413 before they are parsed."""
MAX_UPLOAD_BYTES = 2 << 30
"""The limit for adapter uploads (POST /admin/adapters/upload) instead."""
UPLOAD_PATH = "/admin/adapters/upload"
KEYED_PATHS = ("/tokenize", "/detokenize")
"""Routes outside /v1/ that take a tenant's key (Guard checks it before the body)."""
CONTROL_CONNECTIONS = 32
"""Connections per engine for state polls, aborts and adapter calls (apart from streams)."""


def body_limit(path: str) -> int:
    return MAX_UPLOAD_BYTES if path == UPLOAD_PATH else MAX_BODY_BYTES


def _live_paths(adapters: dict[str, AdapterRecord]) -> dict[str, str]:
    """What an engine coming up is given: every adapter but those being deleted."""
    return {name: a.path for name, a in adapters.items() if not a.deleting}


SHUTDOWN_STEP_S = 5.0
"""How long shutdown waits for each of its steps (background tasks, the store) to end: a
task that does not end on cancellation must not keep a drained gateway alive."""


def create_app(config: GatewayConfig, engine_urls: list[str], tokenizer_dir: str,
               adapters: dict[str, str] | None = None, base_model: str | None = None,
               watch_adapter_dir: str | None = None, local: LocalEngine | None = None,
               store: StateStore | None = None, withheld: Collection[str] = ()) -> FastAPI:
    """A gateway over engine servers at engine_urls and/or the engine in this process
    (``local``: its metrics join the gateway's /metrics); adapters (name -> PEFT dir as the
    engines see it) are registered on every instance as it comes up. watch_adapter_dir: a
    directory where the demo adapters appear while serving (gateway/demo_adapters.py).
    ``store``: the state store, opened by the caller (default: open_store(config)).
    ``withheld``: adapters given on the command line but not served now (an adapter
    directory's member that did not load): their records stand, as an admin left them."""
    check_engine_sources(config, engine_urls, local is not None)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    instance_tag("", config.admin_key)  # its key stretch (scrypt) now, not in a request
    pool_holder: dict[str, InstancePool] = {}
    metrics = GatewayMetrics(lambda: pool_holder.get("pool"))
    name = base_model or config.served_model_name or tokenizer_dir.rstrip("/").split("/")[-1]

    store = store if store is not None else open_store(config)
    pending_deletes = PendingDeletes(config.upload_dir(tokenizer_dir))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        view = StateView(store, config.state_refresh_s)
        await view.refresh()
        if not view.store_available:
            raise RuntimeError(f"the state store at {redact_url(config.redis_url or '')} is "
                               f"unreachable")
        async def register_configured() -> None:
            await bring_to_command_line(store, adapters or {}, {*withheld, *(
                STYLES if watch_adapter_dir is not None else ())})

        await register_configured()
        view.reset_hooks.append(register_configured)  # a Redis that lost them gets them back
        await view.refresh()
        connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0)
        # Control calls apart from the streams: see HttpEngineClient.
        control_connector = aiohttp.TCPConnector(limit=0, limit_per_host=CONTROL_CONNECTIONS)
        async with aiohttp.ClientSession(connector=connector) as http, \
                aiohttp.ClientSession(connector=control_connector) as control_http:
            pool = InstancePool(engine_urls, http, config.eject_after_failures,
                                _live_paths(view.snapshot.adapters),
                                config.routed_prefix_ttl_s, config.engine_token,
                                local={local.instance_id: local} if local else None,
                                control_http=control_http)
            view.listeners.append(lambda snap: setattr(
                pool, "adapter_paths", _live_paths(snap.adapters)))
            pool_holder["pool"] = pool
            pool.kv_events = config.kv_events
            router = Router(config.routing, RouterWeights(
                config.prefix_weight, config.load_weight, config.imbalance))
            limiter = RateLimiter(store, metrics.registry, config.store_failure_policy)
            gateway = Gateway(config, pool, router, metrics, name, view, limiter)
            if config.adapter_resolver_roots:
                gateway.resolver = AdapterResolver(
                    list(config.adapter_resolver_roots),
                    ModelShape.from_hf_config(load_hf_config(tokenizer_dir)))
            app.state.gateway = gateway
            log_auth_mode(config.admin_key, view)
            await pool.poll()
            pending_deletes.resume(gateway)
            tasks = [asyncio.create_task(pool.run(config.poll_interval_s), name="poll"),
                     asyncio.create_task(view.run(), name="state refresh")]
            if watch_adapter_dir is not None:
                tasks.append(asyncio.create_task(watch(Path(watch_adapter_dir), view),
                                                 name="adapter dir watch"))
            if config.redis_url and config.engine_token:
                tasks.append(asyncio.create_task(discover(
                    store, pool, {u.rstrip("/") for u in engine_urls},
                    config.poll_interval_s, config.engine_token), name="registry discovery"))
            elif config.redis_url:
                log.warning("not discovering engines through the Redis registry: its entries "
                            "are only trusted when signed with an --engine-token")
            try:
                yield
            finally:
                await stop_background(tasks, SHUTDOWN_STEP_S)
                pool.close()
                try:
                    async with asyncio.timeout(SHUTDOWN_STEP_S):
                        await store.close()
                except TimeoutError:
                    log.warning("the state store's connections did not close within %g s",
                                SHUTDOWN_STEP_S)

    app = FastAPI(title="loragate", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible gateway over loragate engine instances.",
                  # No 307 to the path without its slash: starlette builds its Location from
                  # the Host header, which a client chooses (an open redirect).
                  docs_url=None, redoc_url=None, redirect_slashes=False)
    install_docs(app)  # /docs with local assets (offline)
    app.state.draining = False
    install_error_handlers(app, openai_routes="/v1/chat/completions, /v1/completions, "
                           "/v1/responses and /v1/models")

    @app.exception_handler(StoreUnavailable)
    async def _store_down(request: Request, exc: StoreUnavailable) -> JSONResponse:
        log.warning("state store unavailable: %s", exc)  # the message holds no credentials
        return answer(request, ApiError(503, "state store unavailable; retry later",
                                        code="store_unavailable",
                                        headers={"Retry-After": str(config.retry_after_s)}))
    app.include_router(build_router(lambda: app.state.gateway, tokenizer))
    app.include_router(build_admin_router(tokenizer_dir, pending_deletes))

    def open_mode() -> bool:
        """No admin key and no tenant (before startup completes: assume none yet)."""
        gateway: Gateway | None = getattr(app.state, "gateway", None)
        return operator_endpoints_open(config.admin_key,
                                       gateway is None or gateway.view.open_mode)

    async def caller_refusal(scope: Scope) -> ApiError | None:
        """The 401 a request's route would answer for its key, before its body is read (the
        routes' own dependencies check again, with the body)."""
        gateway: Gateway | None = getattr(app.state, "gateway", None)
        path = scope["path"]
        try:
            if path.startswith("/admin/") or path in VLLM_ADMIN_PATHS:
                require_admin(Request(scope), config.admin_key)
            elif gateway is not None and (path.startswith("/v1/") or path in KEYED_PATHS):
                await gateway.authenticate(Request(scope))
        except ApiError as exc:
            return exc
        return None

    app.add_middleware(Guard, max_bytes=body_limit,
                       draining=lambda: bool(app.state.draining),
                       retry_after_s=config.retry_after_s,
                       body_timeout_s=config.body_read_timeout_s,
                       restrict_hosts=lambda: bool(config.allowed_hosts) or open_mode(),
                       allowed_hosts=config.allowed_hosts, caller_refusal=caller_refusal)
    route_label = RouteLabels(lambda: app.routes)

    def count_response(scope: Scope, status: int) -> None:
        gateway: Gateway | None = getattr(app.state, "gateway", None)
        if gateway is None:
            return
        route = route_label(scope)
        code = scope.get(ERROR_CODE_KEY) or ("client_closed" if status == 0 else "none")
        gateway.metrics.responses.labels(route, str(status or 499), code).inc()

    # Outside Guard and the routes: a request cut off at the drain deadline ends as a
    # shutdown, whichever of them it was in.
    app.state.shutdown_cutoff = ShutdownCutoff()
    app.add_middleware(app.state.shutdown_cutoff.wrap)
    # Added last: outermost, so refusals are logged and counted too.
    app.add_middleware(AccessLog, observe=count_response)

    # HEAD documented once with GET (one route of both methods would give the schema two
    # operations of one id).
    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # HEAD: load balancers' probes
    async def health() -> JSONResponse:
        pool = pool_holder.get("pool")
        ready = len(pool.healthy()) if pool else 0
        status = "draining" if app.state.draining else "ready" if ready else "no_instances"
        return JSONResponse({"status": status, "ready_instances": ready},
                            status_code=200 if status == "ready" else 503,
                            headers={"Retry-After": str(config.retry_after_s)}
                            if status != "ready" else None)

    # vLLM's names for the same check (SageMaker's load balancer probes /ping).
    app.add_api_route("/ping", health, methods=["GET", "HEAD", "POST"],
                      include_in_schema=False)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version("loragate")}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if config.metrics_token or not open_mode():
            require_operator(request, config.admin_key, config.metrics_token)
        body = generate_latest(metrics.registry)
        if local is not None:  # the engine in this process: its series as an engine's
            body += generate_latest(local.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/instances")
    async def instances(request: Request) -> list[dict[str, Any]]:
        if not open_mode():
            require_operator(request, config.admin_key)
        pool = pool_holder.get("pool")
        if pool is None:
            return []
        routable = {i.instance_id for i in pool.healthy()}  # as the router and /health see
        return [{"instance_id": i.instance_id,
                 "public_id": instance_tag(i.instance_id, config.admin_key),
                 "healthy": i.instance_id in routable, "draining": i.draining,
                 "in_flight": i.in_flight, "num_running": i.num_running,
                 "num_waiting": i.num_waiting, "kv_usage": i.kv_usage,
                 "max_loras": i.max_loras, "resident": sorted(i.resident),
                 "prefix_hit_rate": i.prefix_hit_rate,
                 "prefix_cursor": pool.index.cursor(i.instance_id) if pool.index else 0,
                 "prefix_hashes": pool.index.size(i.instance_id) if pool.index else 0,
                 "prefix_source": pool.prefix_source(i.instance_id),
                 "adapters": {name: asdict(a) for name, a in i.adapters.items()}}
                for i in pool.instances.values()]

    return app


def count_unrouted(app: FastAPI, status: int, code: str) -> None:
    """Count a refusal the connection's protocol sent before any route saw its request (a
    malformed request line, headers too large or too late): its path is unknown."""
    gateway: Gateway | None = getattr(app.state, "gateway", None)
    if gateway is not None:
        gateway.metrics.responses.labels(UNMATCHED, str(status), code).inc()


def check_engine_sources(config: GatewayConfig, engine_urls: Sequence[str],
                         has_local_engine: bool) -> None:
    """Raise ValueError unless the gateway has somewhere to find engines: URLs, an engine
    in this process, or the Redis registry (which needs the token that signs entries).
    A configuration check, so it runs before anything touches the network."""
    if engine_urls or has_local_engine:
        return
    if not config.redis_url:
        raise ValueError("the gateway needs at least one engine URL, or --redis-url to "
                         "discover engines that register there")
    if not config.engine_token:
        raise ValueError("discovering engines through the Redis registry needs --engine-token "
                         "(the engines' token, which signs their registrations)")


def open_store(config: GatewayConfig, check: bool = False) -> StateStore:
    """Redis with --redis-url; else the state file (gateway/sqlite_store.py), or memory when
    state_path says so. Opened before the app starts, so a state file another gateway holds
    is refused with one clear error (a ValueError); ``check``: the same for a Redis server
    that does not answer."""
    if config.redis_url:
        if check:
            check_reachable(config.redis_url)
        return RedisStore(config.redis_url)
    path = resolve_state_path(config.state_path)
    if path is None:
        return MemoryStore()
    store = SqliteStore(path)
    log.info("tenants, keys and adapters persist in %s", path)
    return store


def log_auth_mode(admin_key: str | None, view: StateView) -> None:
    """One line that says which keys the gateway accepts now."""
    tenants = len(view.snapshot.tenants)
    if not admin_key and view.open_mode:
        log.warning("open mode (no API keys required): every request runs as the operator; "
                    "set --admin-key and create tenants to require keys")
    elif view.open_mode:  # so an admin key is set
        log.info("admin key set, no tenants yet: only the admin key is accepted (create "
                 "tenants through /admin/tenants to issue tenant keys)")
    elif admin_key:
        log.info("%d tenant(s): requests need a tenant API key or the admin key", tenants)
    else:
        log.info("%d tenant(s): requests need a tenant API key; the admin API is disabled "
                 "(no admin key)", tenants)
