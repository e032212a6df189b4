"""Every code block of README.md runs: ```python blocks as scripts, ```bash blocks with bash,
each in a fresh process, against a tiny model (LORAGATE_MODEL) and a live open-mode gateway
(LORAGATE_BASE_URL) serving it under the default model's name with the three demo style
adapters (random tiny ones here), as `./dev.sh serve` does once its adapters are trained. A
block preceded by ``<!-- not-tested: why -->`` is skipped (a GPU, several hosts, a server
that runs until stopped, hours of benchmarks), and only those."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.default_model import DEFAULT_MODEL_NAME
from engine.demo_model import make_demo_adapters, make_demo_model
from lora.demo_data import STYLES
from tests.live_servers import start_engine, start_gateway
from tests.tiny_models import TINY_SPEC

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"(?:<!-- not-tested: (?P<why>[^>]*?) -->\n)?```(?P<lang>[a-z]*)\n"
                   r"(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
GATEWAY_HINTS = ("LORAGATE_BASE_URL",)
"""A block that names these needs the live gateway."""


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str
    not_tested: str | None


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [Block(text.count("\n", 0, m.start("code")) + 1, m["lang"], m["code"], m["why"])
            for m in BLOCK.finditer(text)]


BLOCKS = readme_blocks()


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model named demo-model with the demo adapters, like make-demo's layout."""
    model = make_demo_model(tmp_path_factory.mktemp("readme") / "demo-model", TINY_SPEC)
    make_demo_adapters(model, 4)
    return model


@pytest.fixture(scope="module")
def base_url(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("readme-logs")
    styles = tmp_path_factory.mktemp("styles")
    for i, style in enumerate(STYLES):  # the default model's adapter names
        shutil.copytree(demo_model / "adapters" / f"demo-{i}", styles / style)
    engine = start_engine(demo_model, logs, "--adapter-root", str(styles))
    gateway = None
    try:
        engine.wait_ready()
        gateway = start_gateway(demo_model, [engine.url], logs, "--adapter-dir", str(styles),
                                "--served-model-name", DEFAULT_MODEL_NAME).wait_ready()
        yield gateway.url
    finally:
        for server in (gateway, engine):
            if server is not None:
                server.stop()


def test_the_readme_has_blocks_of_each_kind() -> None:
    langs = [b.lang for b in BLOCKS]
    assert langs.count("python") >= 4 and langs.count("bash") >= 10
    # Anything else (a transcript) says why it does not run.
    assert all(b.lang in ("python", "bash") or b.not_tested for b in BLOCKS), langs
    assert "../shared" not in README.read_text()  # links stay inside the repository


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.lang}-line{b.line}" for b in BLOCKS])
def test_readme_block_runs(block: Block, demo_model: Path, request: pytest.FixtureRequest,
                           tmp_path: Path) -> None:
    if block.not_tested is not None:
        pytest.skip(f"marked not-tested: {block.not_tested}")
    env = {**os.environ, "LORAGATE_MODEL": str(demo_model), "TOKENIZERS_PARALLELISM": "false"}
    if any(hint in block.code for hint in GATEWAY_HINTS):
        env["LORAGATE_BASE_URL"] = request.getfixturevalue("base_url")
    # Blocks call .venv/bin/...: the venv running this test, from a scratch directory.
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    command = ([sys.executable, "-c", block.code] if block.lang == "python"
               else ["bash", "-euo", "pipefail", "-c", block.code])
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert done.stdout.strip(), output[-4000:]  # every block shows something
    assert '"error"' not in done.stdout, output[-4000:]  # e.g. curl printing an error body
