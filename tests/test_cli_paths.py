"""Relative path flags are made absolute once, as the command line is parsed, so engines
started from another working directory and the gateway name the same model directory; and
which adapters `serve` registers by itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gateway.cli import build_parser, served_adapters
from gateway.serve import free_port


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


def _peft_dir(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")


def test_the_model_dirs_adapters_are_served_only_by_engines_started_here(
        tmp_path: Path) -> None:
    # Engines attached with --engine load only from their own adapter roots: advertising
    # the model's adapters/ there would answer every request for them with an error.
    _peft_dir(tmp_path / "adapters" / "shout")
    own = str((tmp_path / "adapters" / "shout").resolve())
    assert served_adapters([], None, str(tmp_path), attached=False) == (
        {"shout": own}, str(tmp_path / "adapters"))
    assert served_adapters([], None, str(tmp_path), attached=True) == ({}, None)
    named = served_adapters([], str(tmp_path / "adapters"), str(tmp_path), attached=True)
    assert named == ({"shout": own}, str(tmp_path / "adapters"))


def test_a_lora_path_that_is_no_adapter_is_refused_before_a_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    # The model directory is empty: the refusal has to come before anything reads it.
    assert main(["serve", "--model", str(tmp_path), "--lora", "x=/nonexistent"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "loragate: error: --lora x=/nonexistent: not a PEFT adapter directory (no "
        "adapter_config.json there)"]
    # A path on the engines' hosts (--engine) is theirs to check.
    assert served_adapters(["x=/elsewhere/x"], None, str(tmp_path), attached=True) == (
        {"x": "/elsewhere/x"}, None)


def test_a_missing_model_directory_is_one_line_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    missing = tmp_path / "no-model"
    # An unreachable store would be refused too: the model comes first, in one line.
    assert main(["serve", "--model", str(missing), "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"loragate: error: model directory {str(missing)!r} does not exist"]


def test_a_lora_adapter_that_does_not_load_stops_the_start(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    # Listed and advertised, it would fail every request for it: refused as vLLM refuses a
    # --lora-modules entry, before any engine starts.
    [good, *_] = tiny_adapters.values()
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    for command in (["serve", "--state-path", ""], ["engine", "--port", str(free_port())]):
        assert main([*command, "--model", str(tiny_model_dir), "--lora", f"ok={good}",
                     "--lora", f"bad={broken}"]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"loragate: error: --lora bad={broken}: adapter 'bad': "
                               f"adapter_model.safetensors is corrupt"), command


def test_lora_names_that_could_never_be_reached_stop_the_start(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    a0, a1 = tiny_adapters["a0"], tiny_adapters["a1"]
    for flags, reason in (
            (["--lora", f"a={a0}", "--lora", f"a={a1}"], "--lora a is given more than once"),
            (["--lora", f"{tiny_model_dir.name}={a0}"],
             f"adapter name {tiny_model_dir.name!r} is the base model's name"),
            (["--lora", f"base={a0}", "--served-model-name", "base"],
             "adapter name 'base' is the base model's name")):
        assert main(["serve", "--model", str(tiny_model_dir), "--state-path", "",
                     *flags]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"loragate: error: {reason}"]


def test_an_adapter_directory_s_broken_adapter_is_left_out(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    from engine.adapter_roots import check_served_adapters

    shutil.copytree(tiny_adapters["a0"], tmp_path / "good")
    shutil.copytree(tiny_adapters["a1"], tmp_path / "broken")
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    found = served_adapters([], str(tmp_path), str(tiny_model_dir), attached=False)[0]
    assert set(found) == {"good", "broken"}
    served = check_served_adapters([], found, str(tiny_model_dir), 16, "base", load=True)
    assert served == {"good": found["good"]}  # listed, it would fail every request for it
    assert "not serving the adapter directory's broken: adapter 'broken'" in caplog.text
