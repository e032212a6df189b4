"""One live `loragate engine` process for every module of this package.

The tiny model, two PEFT adapters registered with --lora, and a 64-block KV cache, so a
leaked block shows up in /state. Every test that runs requests ends by polling /state until
nothing runs and no block is in use; when the package ends the engine must drain on SIGTERM
and exit 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.engine_server.helpers import NUM_KV_BLOCKS
from tests.live_servers import LiveServer, start_engine


@pytest.fixture(scope="package")
def adapters(tiny_adapters: dict[str, Path]) -> dict[str, Path]:
    return tiny_adapters


@pytest.fixture(scope="package")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine's --adapter-root: adapters registered through its API go here."""
    return tmp_path_factory.mktemp("engine-adapter-root")


@pytest.fixture(scope="package")
def engine(tiny_model_dir: Path, adapters: dict[str, Path], adapter_root: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine-server-logs"),
                          "--num-kv-blocks", str(NUM_KV_BLOCKS), "--adapter-root",
                          str(adapter_root), adapters=adapters, instance_id="engine-under-test")
    try:
        yield server.wait_ready()
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]  # SIGTERM drains and exits cleanly


@pytest.fixture(scope="package")
def http(engine: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="package")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))
