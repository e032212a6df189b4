"""Import a GGUF checkpoint into a Hugging Face model directory the engine can serve.

transformers reads GGUF (config, tokenizer, weights) and dequantizes the weights to float,
but refuses to ``save_pretrained`` a model it loaded from GGUF. So this module writes the
directory itself: ``model.safetensors`` (float weights, no tied ``lm_head``), ``config.json``
(no ``quantization_config``, which would make every reader look for the GGUF file again),
``generation_config.json`` and the tokenizer files with the chat template.

The output appears whole or not at all: everything is written into a temporary sibling
directory that is renamed to OUT only when complete, so an interrupted import never leaves
a directory that looks like a model but is not one.

Gemma 2 and Gemma 3 GGUF files are refused although the engine serves both families:
transformers' GGUF reader keeps none of ``query_pre_attn_scalar``, the soft-capping values,
Gemma 3's local rope base or its global rope scaling and falls back to defaults that are
wrong for some checkpoints (Gemma 3 4B and larger scale their global rope, Gemma 2 and 3
27B use another query scalar), so an import could serve a silently different model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PretrainedConfig

from engine.config import FLOAT_DTYPES

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
"""The GGUF ``general.architecture`` values import_gguf converts."""
_LOSSY_ARCHITECTURES = ("gemma2", "gemma3")
"""Served from Hugging Face directories, but not importable from GGUF (module docstring)."""

GGUF_DTYPES = {name: getattr(torch, name) for name in FLOAT_DTYPES}
"""The float types ``import_gguf`` can write."""

Progress = Callable[[str], None]


def say(line: str) -> None:
    """The default Progress: one line on stdout, flushed (a first start is watched live)."""
    print(line, flush=True)


def default_dtype() -> str:
    """bfloat16 where a CUDA device will serve the model, float32 on a CPU (where bfloat16
    matmuls are slow and parity with the float reference matters more than size)."""
    return "bfloat16" if torch.cuda.is_available() else "float32"


def gguf_architecture(gguf_file: str | Path) -> str:
    """``general.architecture`` of a GGUF file (e.g. "llama"), read from its metadata only."""
    from gguf import GGUFReader

    path = Path(gguf_file)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as exc:  # wrong magic, truncated file
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {exc}") from exc
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"GGUF file {str(path)!r} has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def check_supported(gguf_file: str | Path) -> str:
    """The file's architecture, or ValueError naming it when the engine cannot serve it."""
    arch = gguf_architecture(gguf_file)
    if arch in _LOSSY_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} of {Path(gguf_file).name!r} cannot be "
                         f"imported: the GGUF reader loses settings it needs (query scalar, "
                         f"rope scaling); serve its Hugging Face checkpoint directory instead")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} of {Path(gguf_file).name!r} is not "
                         f"supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    return arch


def _config_dict(config: PretrainedConfig, dtype: str, architectures: list[str]
                 ) -> dict[str, object]:
    """config.json for readers old and new: no quantization_config; ``torch_dtype`` next to
    transformers 5's ``dtype``; ``rope_theta`` top-level next to ``rope_parameters``."""
    values: dict[str, object] = config.to_diff_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        values.pop(key, None)  # the GGUF file's path and title are no part of the model
    values["architectures"] = architectures
    values["dtype"] = values["torch_dtype"] = dtype
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]
    return values


def _write_weights(model: torch.nn.Module, tied: bool, out: Path) -> None:
    from safetensors.torch import save_file

    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if tied:  # the loaders re-tie lm_head to embed_tokens; safetensors refuses shared storage
        state.pop("lm_head.weight", None)
    path = out / "model.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


def import_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str | None = None,
                progress: Progress = say) -> Path:
    """Convert a Llama-family GGUF file into a Hugging Face directory at ``out_dir``.

    ``dtype``: one of GGUF_DTYPES (default: default_dtype()). ``out_dir`` must not exist yet.
    Raises ValueError for a file that is not GGUF, an architecture the engine does not serve
    or an existing ``out_dir``. Returns ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.shape import ModelShape

    dtype = dtype or default_dtype()
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(GGUF_DTYPES)}")
    src = Path(gguf_file).resolve()
    out = Path(out_dir).resolve()
    if out.exists():
        raise ValueError(f"output directory {str(out)!r} already exists")
    arch = check_supported(src)
    started = time.monotonic()
    progress(f"import-gguf: reading {src.name} ({arch}, {src.stat().st_size >> 20} MiB), "
             f"dequantizing to {dtype}")
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=GGUF_DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    ModelShape.from_hf_config(model.config)  # refuse what the engine could not load
    tied = bool(getattr(model.config, "tie_word_embeddings", False))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
        params = sum(p.numel() for p in model.parameters())
        progress(f"import-gguf: writing {params / 1e6:.0f}M parameters into {out}")
        _write_weights(model, tied, tmp)
        config = _config_dict(model.config, dtype, [type(model).__name__])
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(out)  # atomic on one filesystem: OUT is complete or absent
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"import-gguf: done in {time.monotonic() - started:.0f} s")
    return out
