"""Who may call an engine, and what it may be made to read: the engine token
(engine/http/auth.py) and the adapter roots (engine/adapter_roots.py), against live engine
processes of their own (the package's shared engine runs without a token)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.cli import main
from tests.engine_server.helpers import GREEDY, error_body, post_generate, wait_idle
from tests.live_servers import LiveServer, start_engine

TOKEN = "engine-test-token-7f3a"
UNAUTHORIZED = {"message": "missing or invalid engine token", "type": "authentication_error",
                "param": None, "code": "invalid_token"}
OUTSIDE = {"message": "adapter path is outside the engine's adapter roots (give its "
                      "directory's parent with --adapter-root)",
           "type": "invalid_request_error", "param": "path", "code": None}


@dataclass
class Guarded:
    """A live engine that requires TOKEN, with --adapter-root ``root`` and adapter a0."""

    engine: LiveServer
    root: Path

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return httpx.Client(base_url=self.engine.url, headers=headers, timeout=60.0)


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path, tiny_adapters: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    logs = tmp_path_factory.mktemp("auth-engine")
    root = tmp_path_factory.mktemp("auth-adapter-root")
    token_file = logs / "token"
    token_file.write_text(TOKEN + "\n")  # a trailing newline, as `echo` writes it
    engine = start_engine(tiny_model_dir, logs, "--num-kv-blocks", "64", "--engine-token-file",
                          str(token_file), "--adapter-root", str(root),
                          adapters={"a0": tiny_adapters["a0"]})
    try:
        yield Guarded(engine.wait_ready(), root)  # ready = /health answered without a token
    finally:
        code = engine.stop()
    assert code == 0, engine.log()[-3000:]


ROUTES = [("POST", "/generate", {"prompt": "hi", "params": GREEDY}),
          ("POST", "/generate", {"prompt": "hi", "params": GREEDY, "stream": False}),
          ("POST", "/abort", {"request_id": "someone-elses"}),
          ("GET", "/state", None),
          ("GET", "/adapters", None),
          ("POST", "/adapters", {"name": "x", "path": "/etc"}),
          ("DELETE", "/adapters/a0", None),
          ("POST", "/adapters/a0/pin", {"pinned": True}),
          ("GET", "/metrics", None),
          ("GET", "/openapi.json", None),
          ("GET", "/no-such-route", None)]


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1], TOKEN.upper()])
def test_every_route_but_health_needs_the_token(guarded: Guarded, token: str | None) -> None:
    with guarded.client(token) as http:
        for method, path, body in ROUTES:
            response = http.request(method, path, json=body)
            assert error_body(response, 401) == UNAUTHORIZED, (method, path)
            assert response.headers["www-authenticate"] == "Bearer"
            assert TOKEN not in response.text
        # Another scheme, or the token without its scheme, is refused the same way.
        for header in (TOKEN, f"Basic {TOKEN}", f"Bearer  {TOKEN}"):
            response = http.get("/state", headers={"Authorization": header})
            assert error_body(response, 401) == UNAUTHORIZED
        health = http.get("/health")
        assert (health.status_code, health.json()["status"]) == (200, "ready")
    with guarded.client() as http:  # nothing the refused calls asked for happened
        adapters = http.get("/adapters").json()
        assert [(a["name"], a["pinned"]) for a in adapters] == [("a0", False)]


def test_with_the_token_every_route_works(guarded: Guarded) -> None:
    with guarded.client() as http:
        assert post_generate(http, {"prompt": "hi", "params": GREEDY, "lora": "a0"})[
            "completion_tokens"] == GREEDY["max_tokens"]
        assert http.post("/abort", json={"request_id": "nope"}).json() == {"aborted": False}
        assert http.get("/state").json()["adapters"][0]["name"] == "a0"
        assert http.get("/metrics").status_code == 200
        assert http.post("/adapters/a0/pin", json={"pinned": False}).status_code == 200
        wait_idle(http)


def _adapter_copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_adapter_paths_must_resolve_inside_the_roots(guarded: Guarded,
                                                     tiny_adapters: dict[str, Path],
                                                     tmp_path: Path) -> None:
    outside = tiny_adapters["a1"]  # a valid adapter, but not under the engine's roots
    inside = _adapter_copy(outside, guarded.root / "a1-inside")
    (guarded.root / "escape").symlink_to(outside, target_is_directory=True)
    (guarded.root / "loop").symlink_to(guarded.root / "loop")
    with guarded.client() as http:
        def load(name: str, path: str | Path) -> httpx.Response:
            return http.post("/adapters", json={"name": name, "path": str(path)})

        for path in (outside, guarded.root / "escape",  # a symlink inside pointing out
                     guarded.root / ".." / outside.parent.name / outside.name,
                     guarded.root / "escape" / "..",  # the symlink's target's parent
                     tmp_path / "missing",  # no existence oracle outside the roots
                     "/etc", "/proc/self/root/etc", f"{guarded.root}-sibling",
                     "relative/path", guarded.root / "loop"):
            assert error_body(load("stolen", path), 400) == OUTSIDE, path
        missing = error_body(load("stolen", guarded.root / "missing"), 400)
        assert missing["message"] == "adapter directory does not exist"
        assert "stolen" not in {a["name"] for a in http.get("/adapters").json()}

        loaded = load("a1-inside", inside)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["name"] == "a1-inside"
        # A symlink inside the roots to a place inside the roots is fine.
        (guarded.root / "alias").symlink_to(inside, target_is_directory=True)
        assert load("a1-alias", guarded.root / "alias").status_code == 200
        # The command line's adapters are trusted: their directories are roots too.
        assert load("a0-again", tiny_adapters["a0"]).status_code == 200
        for name in ("a1-inside", "a1-alias", "a0-again"):
            assert http.delete(f"/adapters/{name}").status_code == 200


def test_adapter_load_errors_do_not_reveal_paths(guarded: Guarded,
                                                 tiny_adapters: dict[str, Path]) -> None:
    empty = guarded.root / "empty-adapter"
    empty.mkdir()
    corrupt = _adapter_copy(tiny_adapters["a0"], guarded.root / "corrupt-adapter")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    with guarded.client() as http:
        for path, expected in ((empty, "has no adapter_config.json"),
                               (corrupt, "adapter_model.safetensors is corrupt")):
            refused = error_body(http.post("/adapters", json={"name": "bad",
                                                              "path": str(path)}), 400)
            assert expected in refused["message"]
            assert str(guarded.root) not in refused["message"], refused
            assert str(guarded.root.resolve()) not in refused["message"], refused


REFUSED_HOST = ("loragate: error: refusing to serve the engine API on {} without a token: "
                "set --engine-token-file FILE, --engine-token or LORAGATE_ENGINE_TOKEN (the "
                "gateways need the same token)")


@pytest.fixture
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.delenv("LORAGATE_ENGINE_TOKEN", raising=False)
    return dict(os.environ)


@pytest.fixture
def busy_port() -> Iterator[str]:
    """A port something already listens on: an engine that wrongly started anyway fails to
    bind and exits, rather than serving (and hanging the test)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield str(sock.getsockname()[1])


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_an_engine_on_all_interfaces_without_a_token_refuses_to_start(
        tiny_model_dir: Path, host: str, no_token_env: dict[str, str]) -> None:
    # It must refuse before loading anything; the timeout only bounds a regression (which
    # would serve the API to the network until killed).
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "engine", "--model",
                             str(tiny_model_dir), "--host", host, "--port", "0"],
                            capture_output=True, text=True, env=no_token_env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == REFUSED_HOST.format(host)


@pytest.mark.parametrize("host", ["192.0.2.1", "example.com", "localhost.example.com"])
def test_any_non_loopback_host_needs_a_token(tiny_model_dir: Path, host: str, busy_port: str,
                                             no_token_env: dict[str, str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine", "--model", str(tiny_model_dir), "--host", host, "--port",
                 busy_port]) == 2
    assert capsys.readouterr().err.strip() == REFUSED_HOST.format(host)


def test_bad_token_sources_are_refused(tiny_model_dir: Path, tmp_path: Path, busy_port: str,
                                       no_token_env: dict[str, str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = {("--engine-token-file", str(empty)): f"the engine token file {str(empty)!r} is "
                                                  f"empty",
             ("--engine-token-file", str(tmp_path / "nope")): "cannot read the engine token",
             ("--engine-token", "a", "--engine-token-file", str(empty)):
                 "give either --engine-token or --engine-token-file, not both",
             ("--engine-token", " padded"): "the engine token must be non-empty",
             ("--register-redis-url", "redis://127.0.0.1:1/0"):
                 "--register-redis-url needs an engine token"}
    for flags, message in cases.items():
        argv = ["engine", "--model", str(tiny_model_dir), "--port", busy_port, *flags]
        assert main(argv) == 2, flags
        err = capsys.readouterr().err
        assert message in err, (flags, err)
        assert len(err.strip().splitlines()) == 1, err
