"""import-gguf refuses what the engine cannot serve, naming the architecture it read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from engine.gguf_import import GGUF_ARCHITECTURES, gguf_architecture, import_gguf
from gateway.cli import main


def write_gguf(path: Path, architecture: str) -> Path:
    """A one-tensor GGUF file whose metadata names ``architecture``."""
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_architecture_is_named(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    gguf = write_gguf(tmp_path / "tiny-mamba.gguf", "mamba")
    assert gguf_architecture(gguf) == "mamba"
    with pytest.raises(ValueError, match=r"GGUF architecture 'mamba' of 'tiny-mamba.gguf' is "
                                         r"not supported; supported: llama, mistral, qwen2"):
        import_gguf(gguf, tmp_path / "out")
    assert main(["import-gguf", str(gguf), str(tmp_path / "out")]) == 2
    assert "GGUF architecture 'mamba'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-mamba.gguf"]


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3"])
def test_gemma_gguf_is_refused_with_the_reason(tmp_path: Path, architecture: str) -> None:
    # The engine serves Gemma, but transformers' GGUF reader drops settings Gemma needs.
    gguf = write_gguf(tmp_path / "tiny-gemma.gguf", architecture)
    with pytest.raises(ValueError, match=rf"GGUF architecture '{architecture}' of "
                                         r"'tiny-gemma.gguf' cannot be imported: .* serve its "
                                         r"Hugging Face checkpoint directory instead"):
        import_gguf(gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        import_gguf(fake, tmp_path / "out")
    with pytest.raises(ValueError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_an_existing_output_directory_is_left_alone(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "tiny.gguf", "llama")
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        import_gguf(gguf, tmp_path / "out")


def test_the_help_names_every_architecture_it_imports(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    summary = " ".join(capsys.readouterr().out.split())
    listed = summary.split("convert a Llama-family GGUF file (", 1)[1].split(")", 1)[0]
    assert listed.split(", ") == list(GGUF_ARCHITECTURES)
