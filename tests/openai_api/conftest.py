"""One live engine (tiny model, two adapters) behind one live gateway for every module of
this package, driven by the official `openai` client. When the package ends, every KV block
of the engine must be free again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.live_servers import LiveServer, start_engine, start_gateway
from tests.openai_api.helpers import wait_engine_idle


@pytest.fixture(scope="package")
def adapters(tiny_adapters: dict[str, Path]) -> dict[str, Path]:
    return tiny_adapters


@pytest.fixture(scope="package")
def servers(tiny_model_dir: Path, adapters: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer]]:
    """(engine, gateway), started together: the gateway polls until the engine is up."""
    logs = tmp_path_factory.mktemp("openai-logs")
    engine = start_engine(tiny_model_dir, logs, "--num-kv-blocks", "128", adapters=adapters)
    gateway = start_gateway(tiny_model_dir, [engine.url], logs, adapters=adapters)
    try:
        engine.wait_ready()
        gateway.wait_ready()
        yield engine, gateway
        # Every request of the module has ended: no engine block may still be in use.
        assert wait_engine_idle(engine.url)["kv_blocks_total"] == 128
    finally:
        gateway.stop()
        engine.stop()


@pytest.fixture(scope="package")
def engine(servers: tuple[LiveServer, LiveServer]) -> LiveServer:
    return servers[0]


@pytest.fixture(scope="package")
def gateway(servers: tuple[LiveServer, LiveServer]) -> LiveServer:
    return servers[1]


@pytest.fixture(scope="package")
def client(gateway: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60.0) as c:
        yield c


@pytest.fixture(scope="package")
def base_model(tiny_model_dir: Path) -> str:
    return tiny_model_dir.name


@pytest.fixture(scope="package")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


