"""The engine's own HTTP API over an AsyncEngine, spoken by remote gateways (and benchmarks
going direct). Each route is one typed AsyncEngine command; bodies and stream lines are the
JSON of engine/protocol.py's types.

    POST   /generate                 GenerateRequest; NDJSON StreamChunks (one JSON with
                                     stream=false)
    POST   /abort                    {"request_id"}: end a request, free its blocks
    GET    /state?cursor=N           EngineState: load, KV use, adapters, prefix hashes
    GET    /adapters                 registered adapters (slot, pinned, running requests)
    POST   /adapters                 {"name", "path"}: validate and register a PEFT directory
    DELETE /adapters/{name}          unregister (409 while requests use it)
    POST   /adapters/{name}/pin      {"pinned": bool}
    GET    /health                   200 ready, 503 draining
    GET    /metrics                  Prometheus

Bad input is refused with 400 before the stream starts; a failure after it started is a last
line with ``error`` set. A client that disconnects aborts its request.

Authentication: with a token (see engine/http/auth.py) every route but GET /health needs
``Authorization: Bearer TOKEN`` (401 otherwise); without one the engine listens on loopback
only. Adapter paths given to POST /adapters must lie inside the engine's adapter roots (see
engine/adapter_roots.py).

Draining (SIGTERM): /health turns 503 and /generate refuses new requests with 503, while
requests already in flight finish; then the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.adapter_roots import AdapterRoots
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.http.auth import TokenAuth, check_exposure
from engine.http.bodies import AbortBody, AdapterBody, GenerateBody, PinBody
from engine.http.disconnect import next_or_disconnect
from engine.http.draining import DrainingServer, stop_background
from engine.http.errors import ApiError, install_error_handlers
from engine.http.guarded_protocol import GuardedHttpProtocol
from engine.http.metrics import EngineMetricsRegistry
from engine.invalid_field import field_of
from engine.llm_engine import LLMEngine
from engine.protocol import ChunkStream, EngineError, GenerateRequest, StreamChunk

log = logging.getLogger(__name__)
Background = Callable[[AsyncEngine], Coroutine[Any, Any, None]]
"""A coroutine the engine server runs beside the app, given its engine."""
EXIT_ENGINE_DIED = 70
"""Exit status of an engine process whose engine loop died (EX_SOFTWARE)."""


def create_app(engine: AsyncEngine, instance_id: str = "engine-0",
               model_name: str | None = None,
               background: Sequence[Background] = (),
               token: str | None = None, adapter_roots: AdapterRoots | None = None
               ) -> FastAPI:
    """The engine API over a running AsyncEngine (the app owns it: shut down on exit).
    ``background`` coroutines (e.g. a registry heartbeat, given the engine) run while the
    app serves, and are cancelled and awaited (a few seconds at most) at its end. With a
    ``token``, every route but GET /health requires it; POST /adapters loads only paths
    inside ``adapter_roots`` (none: no adapter can be loaded through the API)."""
    engine.instance_id = instance_id
    engine.model_name = model_name or engine.model_name
    engine.adapter_roots = adapter_roots or AdapterRoots(())
    metrics = EngineMetricsRegistry.of(engine)
    engine.on_output = metrics.observe

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(job(engine)) for job in background]
        yield
        await stop_background(tasks, timeout_s=5.0)
        engine.shutdown()

    # No /docs: Swagger UI would load from a CDN (blank offline), and this API is the
    # gateway's, not a user's; /openapi.json still describes it.
    # redirect_slashes off: a 307's Location would come from the client's Host header.
    app = FastAPI(title="loragate engine", lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False)
    install_error_handlers(app)
    if token is not None:
        app.add_middleware(TokenAuth, token=token)

    @app.post("/generate")
    async def generate(body: GenerateBody, http: Request) -> Response:
        if (body.prompt is None) == (body.prompt_token_ids is None):
            raise ApiError(400, "give exactly one of prompt and prompt_token_ids",
                           param="prompt")
        try:
            ids = (await engine.tokenize_off_loop(body.prompt, body.tenant)
                   if body.prompt is not None else list(body.prompt_token_ids or []))
            request = GenerateRequest.from_json({
                **body.model_dump(), "prompt_token_ids": ids,
                "request_id": body.request_id or engine.new_request_id()})
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc), param=field_of(exc)) from None
        stream = await engine.open(request)
        chunks = _chunks(request.request_id, stream)
        if body.stream:
            return StreamingResponse(_ndjson(chunks), media_type="application/x-ndjson")

        async def whole() -> dict[str, Any]:
            final: StreamChunk | None = None
            text: list[str] = []
            async with contextlib.aclosing(chunks):  # closed early, it aborts the request
                async for chunk in chunks:
                    text.append(chunk.delta_text)
                    final = chunk
            assert final is not None
            return {**final.to_json(), "text": "".join(text)}

        return JSONResponse(await next_or_disconnect(http, whole()))

    @app.post("/abort")
    async def abort(body: AbortBody) -> dict[str, bool]:
        return {"aborted": await engine.abort(body.request_id)}

    @app.get("/state")
    async def get_state(cursor: int = 0) -> dict[str, Any]:
        return (await engine.state(cursor)).to_json()

    @app.get("/adapters")
    async def list_adapters() -> list[dict[str, Any]]:
        return [vars(a) for a in await engine.adapters()]

    @app.post("/adapters")
    async def load_adapter(body: AdapterBody) -> dict[str, Any]:
        return (await engine.load_adapter(body.name, body.path)).to_json()

    @app.delete("/adapters/{name}")
    async def unload_adapter(name: str, digest: str | None = None) -> dict[str, str]:
        await engine.unload_adapter(name, digest)
        return {"name": name, "status": "unloaded"}

    @app.post("/adapters/{name}/pin")
    async def pin_adapter(name: str, body: PinBody) -> dict[str, Any]:
        await engine.pin_adapter(name, body.pinned)
        return {"name": name, "pinned": body.pinned}

    # HEAD documented once with GET (one route of both methods would give the schema two
    # operations of one id).
    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # HEAD: open as GET (auth.py)
    async def health() -> JSONResponse:
        status = "draining" if engine.draining else "ready" if engine.is_alive() else "dead"
        return JSONResponse({"status": status, "in_flight": engine.in_flight},
                            status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        await engine.adapters()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _chunks(request_id: str, stream: ChunkStream
                  ) -> AsyncGenerator[StreamChunk, None]:
    """The request's chunks, the engine dying included (a final error chunk: the client of
    an HTTP stream learns it from the stream). Closing this aborts the request."""
    async with contextlib.aclosing(stream):
        try:
            async for chunk in stream:
                if chunk.error is not None:
                    log.warning("request %s failed: %s", request_id, chunk.error.message)
                yield chunk
        except EngineError as exc:
            log.warning("request %s failed: %s", request_id, exc.message)
            yield StreamChunk.failed(request_id, exc)


async def _ndjson(chunks: AsyncGenerator[StreamChunk, None]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield json.dumps(chunk.to_json(), separators=(",", ":")).encode() + b"\n"


def serve(config: EngineConfig, host: str, port: int, instance_id: str | None = None,
          model_name: str | None = None, adapters: dict[str, str] | None = None,
          drain_timeout_s: float = 30.0,
          background: Sequence[Background] = (),
          token: str | None = None, adapter_roots: Sequence[str] = ()) -> None:
    """Build the engine, register adapters, serve until SIGTERM/SIGINT, then drain.
    Adapters given here are trusted: their directories join ``adapter_roots``. Refuses
    (ValueError, before loading anything) to listen beyond loopback without a token.

    If the engine loop dies (a bug: nothing a client sends can do it), the server stops
    and the process exits with EXIT_ENGINE_DIED, so whoever supervises it (`loragate
    serve`, Kubernetes) restarts it; a dead engine never keeps answering."""
    check_exposure(host, token)
    adapters = adapters or {}
    roots = AdapterRoots([*adapter_roots, *adapters.values()])
    exit_now: list[Callable[[], None]] = []

    def on_fatal(_: BaseException) -> None:
        for stop in exit_now:
            stop()

    engine = AsyncEngine(lambda: load_engine(config, adapters), on_fatal)
    instance_id = instance_id or f"{host}:{port}"
    app = create_app(engine, instance_id, model_name, background, token, roots)
    # The gateway's protocol, at its default limits: an engine reached over the network
    # meets slow and hostile clients too (/health needs no token).
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           http=GuardedHttpProtocol),
                            drain_timeout_s)

    def drain() -> None:
        engine.draining = True
        log.info("engine %s drains: no new requests; those running finish (up to %gs)",
                 instance_id, drain_timeout_s)

    def deadline() -> None:
        count = engine.cut_off()
        log.warning("engine %s stops: %d request(s) still running are ended with a "
                    "'shutting_down' error", instance_id, count)

    server.on_drain = drain
    server.on_deadline = deadline
    # uvicorn's main loop checks should_exit every 0.1 s: setting it from the engine thread
    # is how a dead engine takes its server down.
    exit_now.append(lambda: setattr(server, "should_exit", True))
    server.on_listening = lambda: log.info("engine %s listening on http://%s:%d", instance_id,
                                           host, port)
    server.run()
    if not server.started and engine.fatal_error is None:
        with contextlib.suppress(Exception):  # what was built is let go; the bind is the news
            engine.shutdown()
        raise RuntimeError(f"the engine could not listen on {host}:{port}")
    if engine.fatal_error is not None:
        log.critical("engine %s exits: its engine loop died (%s)", instance_id,
                     type(engine.fatal_error).__name__)
        raise SystemExit(EXIT_ENGINE_DIED)


def load_engine(config: EngineConfig, adapters: dict[str, str]) -> LLMEngine:
    """The engine with the given adapters registered (one bad directory is logged and
    skipped: it must not keep the others offline)."""
    llm = LLMEngine(config)
    for name, path in adapters.items():
        try:
            llm.load_lora(name, path)
        except ValueError as exc:
            log.warning("adapter %s not registered: %s", name, exc)
    return llm
