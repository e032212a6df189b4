"""The gateway's FastAPI app: OpenAI routes, health, metrics, instance view.

    GET  /health        200 while at least one instance is ready and the gateway is not
                        draining, else 503
    GET  /metrics       Prometheus (gateway series)
    GET  /instances     what the router sees of every instance (debugging, benchmarks)
    /v1/...             see gateway/openai_api.py
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from transformers import AutoTokenizer

from engine.http_errors import ApiError, error_body, install_error_handlers
from gateway.admin_api import build_admin_router
from gateway.auth import StateView
from gateway.config import GatewayConfig
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics
from gateway.openai_api import build_router
from gateway.ratelimit import RateLimiter
from gateway.redis_store import RedisStore
from gateway.registry import discover
from gateway.router import Router, RouterWeights
from gateway.service import Gateway
from gateway.store import MemoryStore, StateStore, StoreUnavailable
from gateway.tenancy import AdapterRecord

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20
"""Request bodies above this are refused with 413 before they are parsed."""
MAX_UPLOAD_BYTES = 2 << 30
"""The limit for adapter uploads (POST /admin/adapters/upload) instead."""
UPLOAD_PATH = "/admin/adapters/upload"


def body_limit(path: str) -> int:
    return MAX_UPLOAD_BYTES if path == UPLOAD_PATH else MAX_BODY_BYTES


def create_app(config: GatewayConfig, engine_urls: list[str], tokenizer_dir: str,
               adapters: dict[str, str] | None = None, base_model: str | None = None
               ) -> FastAPI:
    """A gateway over engine servers at engine_urls; adapters (name -> PEFT dir as the
    engines see it) are registered on every instance as it comes up."""
    if not engine_urls and not config.redis_url:
        raise ValueError("the gateway needs at least one engine URL, or --redis-url to "
                         "discover engines that register there")
    if not engine_urls and not config.engine_token:
        raise ValueError("discovering engines through the Redis registry needs --engine-token "
                         "(the engines' token, which signs their registrations)")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pool_holder: dict[str, InstancePool] = {}
    metrics = GatewayMetrics(lambda: pool_holder.get("pool"))
    name = base_model or config.served_model_name or tokenizer_dir.rstrip("/").split("/")[-1]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store: StateStore = RedisStore(config.redis_url) if config.redis_url else MemoryStore()
        view = StateView(store, config.state_refresh_s)
        await view.refresh()
        if not view.store_available:
            raise RuntimeError(f"the state store at {config.redis_url} is unreachable")
        # Adapters given on the command line are public unless the store already knows them.
        for adapter_name, path in (adapters or {}).items():
            if adapter_name not in view.snapshot.adapters:
                await store.put_adapter(AdapterRecord(adapter_name, path))
        await view.refresh()
        connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            pool = InstancePool(engine_urls, http, config.eject_after_failures,
                                {n: a.path for n, a in view.snapshot.adapters.items()},
                                config.routed_prefix_ttl_s, config.engine_token)
            view.listeners.append(lambda snap: setattr(
                pool, "adapter_paths", {n: a.path for n, a in snap.adapters.items()}))
            pool_holder["pool"] = pool
            router = Router(config.routing, RouterWeights(
                config.prefix_weight, config.load_weight, config.imbalance))
            limiter = RateLimiter(store, metrics.registry, config.store_failure_policy)
            gateway = Gateway(config, pool, router, metrics, name, view, limiter)
            app.state.gateway = gateway
            if view.open_mode:
                log.warning("no tenants configured: open mode, requests need no API key "
                            "(create a tenant through the admin API to require keys)")
            await pool.poll()
            tasks = [asyncio.create_task(pool.run(config.poll_interval_s)),
                     asyncio.create_task(view.run())]
            if config.redis_url and config.engine_token:
                tasks.append(asyncio.create_task(discover(
                    store, pool, {u.rstrip("/") for u in engine_urls},
                    config.poll_interval_s, config.engine_token)))
            elif config.redis_url:
                log.warning("not discovering engines through the Redis registry: its entries "
                            "are only trusted when signed with an --engine-token")
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                await store.close()

    app = FastAPI(title="loragate", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible gateway over loragate engine instances.")
    app.state.draining = False
    install_error_handlers(app)

    @app.exception_handler(StoreUnavailable)
    async def _store_down(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return ApiError(503, f"state store unavailable: {exc}", code="store_unavailable",
                        headers={"Retry-After": str(config.retry_after_s)}).response()
    app.include_router(build_router(lambda: app.state.gateway, tokenizer))
    app.include_router(build_admin_router(tokenizer_dir, config.adapter_upload_dir))
    app.add_middleware(Guard, max_bytes=body_limit,
                       draining=lambda: bool(app.state.draining),
                       retry_after_s=config.retry_after_s)

    @app.get("/health")
    async def health() -> JSONResponse:
        pool = pool_holder.get("pool")
        ready = len(pool.healthy()) if pool else 0
        status = "draining" if app.state.draining else "ready" if ready else "no_instances"
        return JSONResponse({"status": status, "ready_instances": ready},
                            status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/instances")
    async def instances() -> list[dict[str, Any]]:
        pool = pool_holder.get("pool")
        if pool is None:
            return []
        return [{"instance_id": i.instance_id, "healthy": i.healthy, "draining": i.draining,
                 "in_flight": i.in_flight, "num_running": i.num_running,
                 "num_waiting": i.num_waiting, "kv_usage": i.kv_usage,
                 "max_loras": i.max_loras, "resident": sorted(i.resident),
                 "prefix_hit_rate": i.prefix_hit_rate,
                 "prefix_cursor": pool.index.cursor(i.instance_id) if pool.index else 0,
                 "prefix_hashes": pool.index.size(i.instance_id) if pool.index else 0,
                 "adapters": {name: asdict(a) for name, a in i.adapters.items()}}
                for i in pool.instances.values()]

    return app


class Guard:
    """Pure ASGI middleware in front of every route (no BaseHTTPMiddleware: that one relays
    every streamed chunk through an extra task and memory stream, a cost paid per token).

    - 413 for a Content-Length over the path's limit, or a body that grows past it while it
      is read (chunked uploads), before anything is parsed;
    - 503 for new generation requests while the gateway drains.
    """

    def __init__(self, app: ASGIApp, max_bytes: Callable[[str], int],
                 draining: Callable[[], bool], retry_after_s: int) -> None:
        self.app = app
        self.max_bytes_for = max_bytes
        self.draining = draining
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        max_bytes = self.max_bytes_for(path)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > max_bytes):
            response = JSONResponse(error_body(413, f"request body over {max_bytes} bytes"),
                                    status_code=413)
            await response(scope, receive, send)
            return
        if self.draining() and path.startswith("/v1/") and scope["method"] == "POST":
            await ApiError(503, "the gateway is shutting down", code="draining",
                           headers={"Retry-After": str(self.retry_after_s)}
                           ).response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    # An HTTPException: FastAPI passes it on from body parsing, and the
                    # error handlers render it in OpenAI's schema.
                    raise StarletteHTTPException(413, f"request body over {max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)
