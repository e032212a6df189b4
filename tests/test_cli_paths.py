"""Relative path flags are made absolute once, as the command line is parsed, so engines
started from another working directory and the gateway name the same model directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import build_parser


@pytest.mark.parametrize("command", ["serve", "engine", "generate", "chat"])
def test_relative_model_is_absolute_after_parsing(command: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "models")
    extra = ["--prompt", "x"] if command == "generate" else []
    args = build_parser().parse_args([command, "--model", "m", *extra])
    assert args.model == str(tmp_path.resolve() / "models" / "m")
    args = build_parser().parse_args([command, "--model", ".", *extra])
    assert args.model == str(tmp_path.resolve() / "models")


def test_free_port_never_hands_out_a_port_twice() -> None:
    from gateway.serve import free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
