"""The examples run end to end against a live gateway and engine (tiny model, three adapters
named like the demo's), with and without an admin key."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from engine.demo_model import make_peft_adapter
from tests.live_servers import LiveServer, start_engine, start_gateway

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ADMIN = "examples-admin"


def load_example(name: str) -> ModuleType:
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gateways(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, LiveServer]]:
    root = tmp_path_factory.mktemp("examples")
    adapters = {f"demo-{i}": make_peft_adapter(tiny_model_dir, root / f"demo-{i}", rank=4,
                                               target_modules=("q_proj", "v_proj"), seed=i)
                for i in range(3)}
    engine = start_engine(tiny_model_dir, root, "--num-kv-blocks", "256", "--adapter-root",
                          str(root))
    servers = {
        "open": start_gateway(tiny_model_dir, [engine.url], root, adapters=adapters),
        "admin": start_gateway(tiny_model_dir, [engine.url], root, "--admin-key", ADMIN,
                               "--adapter-upload-dir", str(root / "uploads"),
                               adapters=adapters),
    }
    try:
        for server in (engine, *servers.values()):
            server.wait_ready()
        yield servers
    finally:
        for server in (*servers.values(), engine):
            server.stop()


def test_corpus_and_retrieval_are_real() -> None:
    corpus = load_example("corpus")
    passages = corpus.load_passages()
    assert len(passages) > 200
    found = corpus.Retriever(passages).search(
        "How does the with statement call __enter__ and __exit__?", k=3)
    assert [p.passage_id for p in found] == sorted(p.passage_id for p in found)
    assert "with" in {p.topic for p in found}


@pytest.mark.parametrize("mode", ["open", "admin"])
def test_rag_pipeline_runs(mode: str, gateways: dict[str, LiveServer],
                           capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--base-url", gateways[mode].url, "--k", "1", "--max-tokens", "4"]
    if mode == "admin":
        args += ["--admin-key", ADMIN]
    load_example("rag_pipeline").main(args)
    out = capsys.readouterr().out
    assert out.count("answer:") == 12
    assert "=== summary ===" in out
    assert "prefix-cache hit rate" in out
    expected = ("docs-bot", "support-bot") if mode == "admin" else ("demo-0", "demo-1")
    for model in expected:
        assert f"model={model}" in out


def test_admin_walkthrough_runs(gateways: dict[str, LiveServer],
                                capsys: pytest.CaptureFixture[str]) -> None:
    load_example("admin_walkthrough").main(["--base-url", gateways["admin"].url,
                                            "--admin-key", ADMIN])
    out = capsys.readouterr().out
    assert "old key -> 401, new key -> 200" in out
    assert "## 8. clean up" in out
