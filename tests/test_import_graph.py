"""The package chain prefix_cache -> lora -> engine -> gateway: a package imports only those
before it, anywhere in its code (function-level and TYPE_CHECKING imports included), and each
package's public names import from the package itself."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAIN = ("prefix_cache", "lora", "engine", "gateway")


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def reverse_edges(root: Path) -> list[str]:
    edges = []
    for rank, package in enumerate(CHAIN):
        later = set(CHAIN[rank + 1:])
        for path in sorted((root / package).rglob("*.py")):
            for target in sorted(imported_packages(path) & later):
                edges.append(f"{path.relative_to(root)} imports {target}")
    return edges


def test_no_package_imports_one_after_it_in_the_chain() -> None:
    assert reverse_edges(ROOT) == []


def test_the_check_finds_a_reverse_edge(tmp_path: Path) -> None:
    for package in CHAIN:
        (tmp_path / package).mkdir()
    (tmp_path / "lora" / "ok.py").write_text("import torch\nfrom prefix_cache import x\n")
    (tmp_path / "lora" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.models import y\n"
        "def f():\n    import gateway.cli\n")
    assert reverse_edges(tmp_path) == ["lora/bad.py imports engine", "lora/bad.py imports gateway"]


@pytest.mark.parametrize("package, names", [
    ("prefix_cache", ["PrefixIndex", "chain_hashes", "PoolAccounting"]),
    ("lora", ["LoraAdapter", "LoraManager", "LoraTargets", "load_adapter"]),
    ("engine", ["LLM", "SamplingParams", "AsyncEngine", "EngineConfig"]),
    ("gateway", ["GatewayConfig"]),
])
def test_public_names_import_from_the_package(package: str, names: list[str]) -> None:
    module = __import__(package)
    assert set(names) <= set(module.__all__)
    assert all(getattr(module, name) is not None for name in names)


def test_the_cli_and_the_packages_import_without_torch() -> None:
    """`loragate --help` and its argument errors answer in a fraction of a second: torch
    (seconds to import) loads with the model code only, not with the packages or the CLI."""
    code = ("import sys, engine, lora, gateway.cli\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
