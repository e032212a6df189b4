"""The engine's own HTTP API, spoken by the gateway (and by benchmarks going direct).

    POST   /generate                 one request; NDJSON stream (or one JSON with stream=false)
    POST   /abort                    {"request_id"}: end a request, free its blocks
    GET    /state?cursor=N           load, KV use, adapters, prefix hashes published since N
    GET    /adapters                 registered adapters (slot, pinned, running requests)
    POST   /adapters                 {"name", "path"}: validate and register a PEFT directory
    DELETE /adapters/{name}          unregister (409 while requests use it)
    POST   /adapters/{name}/pin      {"pinned": bool}
    GET    /health                   200 ready, 503 draining
    GET    /metrics                  Prometheus

Stream lines are StreamChunk objects (see _chunk): request_id, delta_text, delta_token_ids,
finished, finish_reason, logprobs (of the delta tokens), prompt_tokens, completion_tokens,
error. Bad input is refused with 400 before the stream starts; a failure after it started
is a last line with ``error`` set. A client that disconnects aborts its request.

Authentication: with a token (see engine/http_auth.py) every route but GET /health needs
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
from dataclasses import asdict
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.adapter_roots import AdapterPathRefused, AdapterRoots
from engine.async_engine import AsyncEngine, EngineDeadError, EngineInternalError
from engine.config import EngineConfig
from engine.draining_server import DrainingServer
from engine.http_auth import TokenAuth, check_exposure
from engine.http_errors import ApiError, install_error_handlers
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server_bodies import AbortBody, AdapterBody, GenerateBody, PinBody
from engine.server_metrics import EngineCollector, EngineMetricsRegistry
from lora.manager import AdapterInfo

log = logging.getLogger(__name__)
EXIT_ENGINE_DIED = 70
"""Exit status of an engine process whose engine loop died (EX_SOFTWARE)."""


class EngineServer:
    """State of one engine process behind its HTTP API."""

    def __init__(self, engine: AsyncEngine, instance_id: str, model_name: str) -> None:
        self.engine = engine
        self.instance_id = instance_id
        self.model_name = model_name
        self.draining = False
        self.in_flight = 0
        self._adapters: list[AdapterInfo] = engine.engine.list_loras()
        config = engine.engine.config
        self.metrics = EngineMetricsRegistry(EngineCollector(
            engine.stats, lambda: self._adapters, config.max_loras))

    async def refresh_adapters(self) -> list[AdapterInfo]:
        self._adapters = await self.engine.call(self.engine.engine.list_loras)
        return self._adapters

    def observe(self, out: RequestOutput, new_tokens: int) -> None:
        timing = out.timing
        if timing is None or timing.first_token is None:
            return
        itl = timing.inter_token_latencies
        if new_tokens and len(out.token_ids) == new_tokens:  # first output of the request
            self.metrics.ttft.observe(timing.first_token - timing.arrival)
            recent = itl
        else:
            recent = itl[-new_tokens:] if new_tokens else []
        for gap in recent:
            self.metrics.itl.observe(gap)
        if out.finished and timing.last_token is not None:
            self.metrics.e2e.observe(timing.last_token - timing.arrival)


def _chunk(out: RequestOutput, logprob_start: int) -> dict[str, Any]:
    logprobs = None
    if out.logprobs is not None:
        logprobs = [{str(k): v for k, v in step.items()} for step in out.logprobs[logprob_start:]]
    return {
        "request_id": out.request_id, "delta_text": out.delta_text,
        "delta_token_ids": out.delta_token_ids, "finished": out.finished,
        "finish_reason": out.finish_reason, "logprobs": logprobs,
        "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
        "error": None if out.error is None else {"message": out.error, "type": "server_error"},
    }


def _error_chunk(request_id: str, message: str) -> dict[str, Any]:
    return {"request_id": request_id, "delta_text": "", "delta_token_ids": [], "finished": True,
            "finish_reason": "error", "logprobs": None, "prompt_tokens": 0,
            "completion_tokens": 0, "error": {"message": message, "type": "server_error"}}


def create_app(engine: AsyncEngine, instance_id: str = "engine-0",
               model_name: str | None = None,
               background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
               token: str | None = None, adapter_roots: AdapterRoots | None = None
               ) -> FastAPI:
    """The engine API over a running AsyncEngine (the app owns it: shut down on exit).
    ``background`` coroutines (e.g. a registry heartbeat) run while the app serves. With a
    ``token``, every route but GET /health requires it; POST /adapters loads only paths
    inside ``adapter_roots`` (none: no adapter can be loaded through the API)."""
    roots = adapter_roots or AdapterRoots(())
    state = EngineServer(engine, instance_id,
                         model_name or engine.engine.config.model.rstrip("/").split("/")[-1])

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(job()) for job in background]
        yield
        for task in tasks:
            task.cancel()
        engine.shutdown()

    app = FastAPI(title="loragate engine", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    if token is not None:
        app.add_middleware(TokenAuth, token=token)

    @app.post("/generate")
    async def generate(body: GenerateBody) -> Response:
        if state.draining:
            raise ApiError(503, "engine is draining", code="draining")
        if (body.prompt is None) == (body.prompt_token_ids is None):
            raise ApiError(400, "give exactly one of prompt and prompt_token_ids",
                           param="prompt")
        try:
            params = SamplingParams(**body.params.model_dump())
            request = engine.make_request(
                body.prompt if body.prompt is not None else list(body.prompt_token_ids or []),
                params, body.request_id, body.priority, body.lora, body.cache_salt)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        outputs = engine.stream(request)
        if body.stream:
            return StreamingResponse(_ndjson(state, request.request_id, outputs),
                                     media_type="application/x-ndjson")
        final: dict[str, Any] | None = None
        text: list[str] = []
        async with contextlib.aclosing(_chunks(state, request.request_id, outputs)) as chunks:
            async for chunk in chunks:
                text.append(chunk["delta_text"])
                final = chunk
        assert final is not None
        return JSONResponse({**final, "text": "".join(text)})

    @app.post("/abort")
    async def abort(body: AbortBody) -> dict[str, bool]:
        request_id = body.request_id
        known = await engine.call(lambda: request_id in engine.engine.scheduler.requests)
        await engine.abort(request_id)
        return {"aborted": known}

    @app.get("/state")
    async def get_state(cursor: int = 0) -> dict[str, Any]:
        stats = engine.stats()
        config = engine.engine.config
        adapters = await state.refresh_adapters()
        update = await engine.call(lambda: engine.engine.publish_prefixes(cursor))
        return {
            "instance_id": state.instance_id, "model": state.model_name,
            "draining": state.draining, "in_flight": state.in_flight,
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "num_swapped": stats.num_swapped, "kv_blocks_used": stats.kv_blocks_used,
            "kv_blocks_total": stats.kv_blocks_total, "max_loras": config.max_loras,
            "max_lora_rank": config.max_lora_rank,
            "max_num_seqs": config.max_num_seqs, "block_size": config.block_size,
            "publish_every": config.prefix_publish_every,
            "max_model_len": engine.engine.max_model_len,
            "max_request_tokens": min(engine.engine.max_model_len,
                                      engine.engine.kv.max_tokens_per_request()),
            "prefix_hit_rate": stats.prefix_cache.hit_rate,
            "kv_pools": {name: {"used_blocks": pool.used_blocks,
                                "cached_blocks": pool.cached_blocks,
                                "evictions": pool.evictions, "hit_rate": pool.hit_rate}
                         for name, pool in stats.kv_pools.items()},
            "adapters": [asdict(a) for a in adapters],
            "prefix": {"cursor": update.cursor, "full": update.full,
                       "added": [format(h, "x") for h in update.added],
                       "removed": [format(h, "x") for h in update.removed]},
        }

    @app.get("/adapters")
    async def list_adapters() -> list[dict[str, Any]]:
        return [asdict(a) for a in await state.refresh_adapters()]

    @app.post("/adapters")
    async def load_adapter(body: AdapterBody) -> dict[str, Any]:
        """Validate and register; an adapter of the same name and other content replaces the
        registered one only when no request (running, queued or preempted) uses it: 409
        while one does, so no request of the new content runs on the old weights."""
        llm = engine.engine
        try:
            path = roots.check(body.path)
        except AdapterPathRefused as exc:
            raise ApiError(400, str(exc), param="path") from None
        try:
            adapter = await asyncio.to_thread(llm.validate_lora, body.name, str(path))
        except ValueError as exc:
            # Validation messages name the directory: the caller learns what is wrong with
            # the adapter, not where the engine's files are.
            raise ApiError(400, _without_paths(str(exc), body.path, str(path)),
                           param="path") from None
        except OSError:
            raise ApiError(400, "the adapter's files could not be read", param="path") from None

        def add() -> None:  # on the engine thread, between steps
            held = {a.name: a.digest for a in llm.list_loras()}
            if held.get(adapter.name, adapter.digest) != adapter.digest:
                llm.remove_lora(adapter.name)  # ValueError while a request uses it
            llm.add_lora(adapter)

        try:
            await engine.call(add)
        except ValueError as exc:
            raise ApiError(409, str(exc), code="adapter_in_use") from None
        await state.refresh_adapters()
        return {"name": adapter.name, "digest": adapter.digest, "rank": adapter.rank}

    @app.delete("/adapters/{name}")
    async def unload_adapter(name: str) -> dict[str, str]:
        try:
            await engine.call(lambda: engine.engine.remove_lora(name))
        except ValueError as exc:
            status = 409 if "in use" in str(exc) else 404
            raise ApiError(status, str(exc)) from None
        await state.refresh_adapters()
        return {"name": name, "status": "unloaded"}

    @app.post("/adapters/{name}/pin")
    async def pin_adapter(name: str, body: PinBody) -> dict[str, Any]:
        try:
            await engine.call(lambda: engine.engine.pin_lora(name, body.pinned))
        except ValueError as exc:
            raise ApiError(404, str(exc)) from None
        return {"name": name, "pinned": body.pinned}

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = engine.is_alive()
        status = "draining" if state.draining else "ready" if alive else "dead"
        return JSONResponse({"status": status, "in_flight": state.in_flight},
                            status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        await state.refresh_adapters()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _without_paths(message: str, *paths: str) -> str:
    """message with every given path (longest first: one may contain another) as <path>."""
    for path in sorted({p for p in paths if p}, key=len, reverse=True):
        message = message.replace(repr(path), "<path>").replace(path, "<path>")
    return message


async def _chunks(state: EngineServer, request_id: str, outputs: AsyncGenerator[RequestOutput, None]
                  ) -> AsyncGenerator[dict[str, Any], None]:
    """Chunks of one request; closing this iterator aborts the request in the engine."""
    state.in_flight += 1
    reported = 0
    try:
        async with contextlib.aclosing(outputs) as stream:
            async for out in stream:
                state.observe(out, len(out.delta_token_ids))
                if out.error is not None:
                    log.warning("request %s failed: %s", request_id, out.error)
                yield _chunk(out, reported)
                reported = len(out.token_ids)
    except (EngineDeadError, EngineInternalError, ValueError) as exc:
        log.warning("request %s failed: %s", request_id, exc)
        yield _error_chunk(request_id, str(exc))
    finally:
        state.in_flight -= 1


async def _ndjson(state: EngineServer, request_id: str,
                  outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(_chunks(state, request_id, outputs)) as chunks:
        async for chunk in chunks:
            yield json.dumps(chunk, separators=(",", ":")).encode() + b"\n"


def serve(config: EngineConfig, host: str, port: int, instance_id: str | None = None,
          model_name: str | None = None, adapters: dict[str, str] | None = None,
          drain_timeout_s: float = 30.0,
          background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
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

    engine = AsyncEngine.from_config(config, on_fatal=on_fatal)
    for name, path in adapters.items():
        try:
            engine.engine.load_lora(name, path)
        except ValueError as exc:  # one bad directory must not keep the others offline
            log.warning("adapter %s not registered: %s", name, exc)
    instance_id = instance_id or f"{host}:{port}"
    app = create_app(engine, instance_id, model_name, background, token, roots)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=int(drain_timeout_s)))
    server.on_drain = lambda: setattr(app.state.server, "draining", True)
    # uvicorn's main loop checks should_exit every 0.1 s: setting it from the engine thread
    # is how a dead engine takes its server down.
    exit_now.append(lambda: setattr(server, "should_exit", True))
    log.info("engine %s listening on http://%s:%d", instance_id, host, port)
    server.run()
    if engine.fatal_error is not None:
        log.critical("engine %s exits: its engine loop died (%s)", instance_id,
                     type(engine.fatal_error).__name__)
        raise SystemExit(EXIT_ENGINE_DIED)
