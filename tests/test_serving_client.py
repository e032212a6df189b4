"""The serving benchmark against a real local HTTP server (starlette on uvicorn in a thread)
that streams canned OpenAI SSE and engine NDJSON answers: parsing, token counting, failures,
the Prometheus delta and the CLI."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.serving import BenchConfig, BenchResult, main, run_benchmark
from benchmarks.serving_client import ServingRequest


@dataclass
class FakeServer:
    """What the fake server saw: request bodies and how many streams it finished."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    served: int = 0


def sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(state: FakeServer) -> Starlette:
    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "base-model"}, {"id": "x"}]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        state.bodies.append(body)
        if body["model"] == "bad-adapter":
            return JSONResponse({"error": {"message": "adapter not found", "type": "nf"}}, 404)
        n = body["max_tokens"]

        async def stream() -> AsyncIterator[str]:
            for _ in range((n + 1) // 2):  # two tokens per chunk
                yield sse({"choices": [{"index": 0, "text": "ab", "finish_reason": None}]})
            if body["model"] == "trunc":
                return
            yield sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            yield sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
            state.served += 1  # before the last line: the client may stop reading there
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    async def generate(request: Request) -> Response:
        body = await request.json()
        state.bodies.append(body)
        if body["lora"] == "missing":
            return JSONResponse({"detail": "unknown adapter 'missing'"}, 404)
        n = body["params"]["max_tokens"]

        async def stream() -> AsyncIterator[str]:
            base = {"request_id": "r", "delta_text": "a", "finish_reason": None, "error": None,
                    "prompt_tokens": len(body["prompt_token_ids"])}
            for i in range(n):
                last = i == n - 1
                state.served += last
                yield json.dumps({**base, "delta_token_ids": [7], "finished": last,
                                  "finish_reason": "length" if last else None,
                                  "completion_tokens": i + 1}) + "\n"
                if body["lora"] == "boom":
                    error = {"message": "engine died", "type": "internal"}
                    yield json.dumps({**base, "delta_token_ids": [], "error": error}) + "\n"
                    return
        return StreamingResponse(stream(), media_type="application/x-ndjson")

    async def metrics(_: Request) -> Response:
        k = state.served
        return PlainTextResponse(
            "# TYPE loragate_prefix_cache_hit_tokens_total counter\n"
            f'loragate_prefix_cache_hit_tokens_total{{lora="a"}} {10 * k}\n'
            f'loragate_prefix_cache_hit_tokens_total{{lora="b"}} {5 * k}\n'
            "# TYPE loragate_prefix_cache_query_tokens_total counter\n"
            f"loragate_prefix_cache_query_tokens_total {60 * k}\n")

    return Starlette(routes=[
        Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]), Route("/metrics", metrics)])


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    state = FakeServer()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections queue in the kernel until uvicorn's loop accepts them
    state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def run(config: BenchConfig, requests: list[ServingRequest]) -> BenchResult:
    return asyncio.run(run_benchmark(config, requests))


def test_openai_sse_counts_usage_tokens_and_chunk_gaps(fake_server: FakeServer) -> None:
    requests = [ServingRequest((5, 6, 7), 5), ServingRequest((8, 9), 6, lora="demo-1")]
    fake_server.bodies.clear()
    result = run(BenchConfig(fake_server.url, "openai",
                             metrics_urls=(f"{fake_server.url}/metrics",)), requests)
    assert result.model_name == "base-model"
    assert [r.output_tokens for r in result.records] == [5, 6]
    # 3 chunks of text each (the empty finish chunk and the usage chunk carry no tokens).
    assert [len(r.itl_s) for r in result.records] == [2, 2]
    for r in result.records:
        assert 0 < r.ttft_s <= r.ttft_s + sum(r.itl_s) <= r.e2e_s
        assert r.tpot_s == (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
    assert (result.metrics.completed, result.metrics.total_input_tokens) == (2, 5)
    assert result.metrics.total_output_tokens == 11
    assert sorted(b["model"] for b in fake_server.bodies) == ["base-model", "demo-1"]
    body = next(b for b in fake_server.bodies if b["model"] == "base-model")
    assert body == {"model": "base-model", "prompt": [5, 6, 7], "max_tokens": 5,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True}
    assert result.prefix_cache is not None
    assert (result.prefix_cache.hit_tokens, result.prefix_cache.query_tokens) == (30.0, 120.0)
    assert result.prefix_cache.hit_rate == 0.25


def test_openai_failures_are_counted_not_raised(fake_server: FakeServer) -> None:
    requests = [ServingRequest((1,), 4, lora="bad-adapter"), ServingRequest((1,), 4, "trunc"),
                ServingRequest((1,), 4)]
    result = run(BenchConfig(fake_server.url, "openai", model_name="m", rate=50.0,
                             max_concurrency=1), requests)
    assert (result.metrics.completed, result.metrics.failed) == (1, 2)
    assert result.metrics.failures == {"http 404": 1, "Truncated": 1}
    assert result.records[0].error == "adapter not found"
    assert result.records[1].status_code == 200
    starts = [r.start_s for r in result.records]
    assert starts == sorted(starts)


def test_engine_ndjson_stream_and_errors(fake_server: FakeServer) -> None:
    requests = [ServingRequest((3, 4), 4, lora="a"), ServingRequest((3,), 4, lora="boom"),
                ServingRequest((3,), 4, lora="missing"), ServingRequest((3,), 1)]
    fake_server.bodies.clear()
    result = run(BenchConfig(fake_server.url, "engine"), requests)
    good, boom, missing, single = result.records
    assert (good.success, good.output_tokens, len(good.itl_s)) == (True, 4, 3)
    assert (single.success, single.output_tokens, single.itl_s, single.tpot_s) == (
        True, 1, (), None)
    assert boom.error == "ServerError: engine died" and boom.status_code == 200
    assert (missing.status_code, missing.error) == (404, "unknown adapter 'missing'")
    assert result.metrics.failures == {"ServerError": 1, "http 404": 1}
    assert result.model_name is None and result.prefix_cache is None
    assert next(b for b in fake_server.bodies if b["lora"] == "a") == {
        "prompt_token_ids": [3, 4], "params": {"max_tokens": 4, "temperature": 0,
                                               "ignore_eos": True},
        "lora": "a", "cache_salt": None, "priority": 0, "stream": True}


def test_unreachable_server_fails_each_request() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run(BenchConfig(f"http://127.0.0.1:{port}", "engine", timeout_s=5),
                 [ServingRequest((1,), 2), ServingRequest((2,), 2)])
    assert result.metrics.failures == {"ConnectError": 2}
    assert result.metrics.completed == 0 and result.metrics.ttft.mean_ms == 0.0


def test_cli_rag_with_adapters_writes_json(fake_server: FakeServer, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    fake_server.bodies.clear()
    main(["--base-url", fake_server.url + "/", "--workload", "rag", "--num-requests", "6",
          "--num-documents", "8", "--rag-output-len", "3", "--num-adapters", "2",
          "--goodput", "ttft:60000", "--slo-e2e-ms", "60000", "--api-key", "secret",
          "--out", str(out), "--save-detailed"])
    saved = json.loads(out.read_text())
    assert saved["metrics"]["completed"] == 6
    assert saved["metrics"]["goodput"] > 0
    assert saved["config"]["slo"] == {"ttft_ms": 60000.0, "tpot_ms": None, "e2e_ms": 60000.0}
    assert saved["config"]["rate"] == "inf" and saved["config"]["api_key"] == "<redacted>"
    assert len(saved["records"]) == 6
    assert {b["model"] for b in fake_server.bodies} <= {"demo-0", "demo-1"}
    assert "Serving Benchmark Result" in capsys.readouterr().out
