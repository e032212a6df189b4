"""The engine token between live gateways and live engines: a gateway holding it serves end to
end (every engine call it makes carries it), one without it gets no traffic through, and the
engines `loragate serve` starts itself always require a token, given through their
environment, never their command line."""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest

from engine.protocol import EngineUnavailable, GenerateRequest
from engine.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.engine_client import ClientTimeouts, HttpEngineClient
from tests.live_http import instances, poll
from tests.live_servers import LiveServer, start_engine, start_gateway

TOKEN = "live-engine-token-51c2"
ADMIN = "auth-admin-key"
UNAUTHORIZED = {"error": {"message": "missing or invalid engine token",
                          "type": "authentication_error", "param": None,
                          "code": "invalid_token"}}


@dataclass
class Guarded:
    engine: LiveServer
    token_file: Path
    logs: Path


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path, tiny_adapters: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    """An engine requiring TOKEN, which may load the tiny adapters through its API."""
    logs = tmp_path_factory.mktemp("engine-auth-live")
    token_file = logs / "token"
    token_file.write_text(TOKEN)
    engine = start_engine(tiny_model_dir, logs, "--num-kv-blocks", "128", "--engine-token-file",
                          str(token_file), "--adapter-root",
                          str(tiny_adapters["a0"].parent))
    try:
        yield Guarded(engine.wait_ready(), token_file, logs)
    finally:
        engine.stop()


def complete(url: str, model: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", timeout=60.0, headers=headers,
                      json={"model": model, "prompt": "hello", "max_tokens": 3,
                            "temperature": 0, "ignore_eos": True})


def test_a_gateway_with_the_token_serves_end_to_end(guarded: Guarded, tiny_model_dir: Path,
                                                    tiny_adapters: dict[str, Path]) -> None:
    # a0 is not on the engine's command line: the gateway registers it through the API.
    gateway = start_gateway(tiny_model_dir, [guarded.engine.url], guarded.logs,
                            "--engine-token-file", str(guarded.token_file),
                            "--served-model-name", "base",
                            adapters={"a0": tiny_adapters["a0"]})
    try:
        gateway.wait_ready()  # ready = its /state polls were accepted
        for model in ("base", "a0"):
            response = complete(gateway.url, model)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 3
        (instance,) = instances(gateway.url).values()
        assert sorted(instance["adapters"]) == ["a0"]
        wait_idle(guarded.engine.url)
        assert TOKEN not in gateway.log()
    finally:
        gateway.stop()


def wait_idle(url: str, token: str = TOKEN) -> None:
    def idle() -> bool:
        state = httpx.get(url + "/state", headers={"Authorization": f"Bearer {token}"},
                          timeout=5.0).json()
        return (state["num_running"], state["num_waiting"], state["kv_blocks_used"]) == (
            0, 0, 0)
    poll(idle, f"{url} to be idle")


def test_a_gateway_without_the_token_routes_nothing_there(guarded: Guarded,
                                                         tiny_model_dir: Path) -> None:
    gateway = start_gateway(tiny_model_dir, [guarded.engine.url], guarded.logs,
                            "--served-model-name", "base")
    try:
        poll(lambda: "refused this gateway's engine token (HTTP 401)" in gateway.log(),
             "the gateway to log the refused token")
        response = complete(gateway.url, "base")
        assert response.status_code == 503, response.text  # not the tenant's fault: no 401
        assert httpx.get(gateway.url + "/health", timeout=5.0).status_code == 503
        assert [i["healthy"] for i in instances(gateway.url).values()] == [False]
    finally:
        gateway.stop()


def test_the_engine_client_sends_the_token_on_every_call(guarded: Guarded,
                                                         tiny_adapters: dict[str, Path]) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            client = HttpEngineClient(guarded.engine.url, http, token=TOKEN)
            assert (await client.state()).instance_id == f"engine-{_port(guarded)}"
            assert (await client.load_adapter("copy", str(tiny_adapters["a1"]))).rank == 8
            await client.pin_adapter("copy", True)
            assert (await client.state()).adapters[-1].pinned
            # A long request, aborted through the client: the stream ends as aborted.
            request = GenerateRequest("to-abort", [5, 6, 7], SamplingParams(
                max_tokens=900, ignore_eos=True), adapter="copy")
            stream = await client.open(request)
            chunks = [await anext(stream), await anext(stream)]
            assert await client.abort("to-abort")
            async for chunk in stream:
                chunks.append(chunk)
            assert chunks[-1].finish_reason == "abort"
            await client.pin_adapter("copy", False)
            await client.unload_adapter("copy")
            assert "copy" not in {a.name for a in (await client.state()).adapters}

            anonymous = HttpEngineClient(guarded.engine.url, http)
            with pytest.raises(EngineUnavailable, match="HTTP 401"):
                await anonymous.state()
            with pytest.raises(EngineUnavailable, match="HTTP 401"):
                await anonymous.open(request)

    asyncio.run(scenario())
    wait_idle(guarded.engine.url)


def test_control_calls_do_not_wait_behind_streams_for_a_connection(guarded: Guarded) -> None:
    # One connection for streams, held by a long one: a state poll sharing that pool waits
    # for it (and would look like an engine that stopped answering); on its own it answers.
    async def scenario() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as streams, \
                aiohttp.ClientSession() as control:
            timeouts = ClientTimeouts(connect=0.5, control=2.0, state=2.0)
            apart = HttpEngineClient(guarded.engine.url, streams, timeouts, TOKEN, control)
            shared = HttpEngineClient(guarded.engine.url, streams, timeouts, TOKEN)
            stream = await apart.open(GenerateRequest("long", [5, 6, 7], SamplingParams(
                max_tokens=900, ignore_eos=True)))
            await anext(stream)
            assert (await apart.state()).num_running == 1
            with pytest.raises(EngineUnavailable) as waited:
                await shared.state()
            assert isinstance(waited.value.__cause__, TimeoutError)
            assert await apart.abort("long")
            await stream.aclose()

    asyncio.run(scenario())
    wait_idle(guarded.engine.url)


def _port(guarded: Guarded) -> str:
    return guarded.engine.url.rsplit(":", 1)[1]


def test_the_token_never_shows_in_the_config_or_its_errors() -> None:
    assert TOKEN not in repr(GatewayConfig(engine_token=TOKEN))
    with pytest.raises(ValueError) as refused:
        GatewayConfig(engine_token=f" {TOKEN}")
    assert TOKEN not in str(refused.value)


# --------------------------------------------------------------------- loragate serve
def _children(pid: int) -> list[int]:
    """Child process ids (Linux /proc), from every thread of pid."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _tar(directory: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(directory, arcname=directory.name)
    return buffer.getvalue()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_engines_started_by_serve_require_a_token_given_through_the_environment(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    uploads = tmp_path / "uploads"
    gateway = start_gateway(tiny_model_dir, [], tmp_path, "--instances", "1",
                            "--engine-process", "--admin-key", ADMIN, "--adapter-upload-dir",
                            str(uploads), "--served-model-name", "base")
    try:
        gateway.wait_ready()
        (engine_url,) = instances(gateway.url, ADMIN)
        # The child engine refuses a caller without the token; its /health stays open.
        direct = httpx.get(engine_url + "/state", timeout=10.0)
        assert (direct.status_code, direct.json()) == (401, UNAUTHORIZED)
        assert httpx.get(engine_url + "/health", timeout=10.0).status_code == 200
        (child,) = _children(gateway.process.pid)
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in item)
        token = environ["LORAGATE_ENGINE_TOKEN"]
        assert len(token) >= 32
        assert token not in Path(f"/proc/{child}/cmdline").read_text()
        assert token not in gateway.log()
        authed = httpx.get(engine_url + "/state", timeout=10.0,
                           headers={"Authorization": f"Bearer {token}"})
        assert authed.status_code == 200

        assert complete(gateway.url, "base", ADMIN).status_code == 200
        # Uploads land in a directory the engines accept adapters from.
        upload = httpx.post(gateway.url + "/admin/adapters/upload?name=up&public=true",
                            timeout=60.0,
                            headers={"Authorization": f"Bearer {ADMIN}"},
                            content=_tar(tiny_adapters["a1"]))
        assert upload.status_code == 201, upload.text
        response = complete(gateway.url, "up", ADMIN)
        assert response.status_code == 200, response.text
        wait_idle(engine_url, token)
    finally:
        assert gateway.stop() == 0, gateway.log()[-3000:]

