"""The suite's record of headline figures: the latest run of every benchmark on every model.

benchmarks/suite_figures.json (committed, written by ``python -m benchmarks``) holds, per model
label and benchmark, the rows of its latest run at a benchmark size (``full``, ``medium``)
with when it ran, the commit measured, the exact arguments and the thread count. A run
replaces only the entries of the model and benchmarks it ran, so models and benchmarks
measured at other times keep their figures; the RESULTS.md block is rendered from this file
alone. Smoke runs (``--size quick``) never enter it.
"""

from __future__ import annotations

import ast
import json
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GENERATED = ("benchmarks/RESULTS.md", "benchmarks/suite_figures.json", "benchmarks/plots")
"""Paths the suite itself writes: changes there do not make the measured tree dirty."""


@dataclass(frozen=True)
class Row:
    """One headline figure of a benchmark report, beside its target."""

    benchmark: str
    metric: str
    value: str
    target: str


@dataclass(frozen=True)
class PartRecord:
    """One benchmark's latest run on one model."""

    size: str
    args: tuple[str, ...]
    """The benchmark's own arguments beyond --model and the output path."""
    threads: int | None
    """Torch threads per process (the suite's --threads); None = torch's default."""
    stamp: str
    """When the run started, UTC, ISO 8601 to the minute."""
    commit: str
    """Short hash of the commit measured, '+' appended when tracked files had changes."""
    seconds: float | None
    rows: tuple[Row, ...]
    note: str = ""
    """Anything the run line must add (e.g. rows carried over from another run)."""


@dataclass
class ModelRecord:
    """Every benchmark's latest run on one model, and what the model is."""

    description: str
    parts: dict[str, PartRecord] = field(default_factory=dict)


def load(path: Path) -> dict[str, ModelRecord]:
    """label -> record; empty when the file does not exist yet."""
    if not path.exists():
        return {}
    raw: dict[str, Any] = json.loads(path.read_text())["models"]
    models = {}
    for label, model in raw.items():
        parts = {name: PartRecord(**{**part, "args": tuple(part["args"]),
                                     "rows": tuple(Row(**row) for row in part["rows"])})
                 for name, part in model["parts"].items()}
        models[label] = ModelRecord(model["description"], parts)
    return models


def save(path: Path, models: dict[str, ModelRecord]) -> None:
    payload = {"models": {label: {"description": m.description,
                                  "parts": {name: asdict(p) for name, p in m.parts.items()}}
                          for label, m in models.items()}}
    path.write_text(json.dumps(payload, indent=1) + "\n")


def merge(models: dict[str, ModelRecord], label: str, description: str,
          parts: dict[str, PartRecord]) -> dict[str, ModelRecord]:
    """models with the given parts of one model replaced (others kept, order kept)."""
    merged = dict(models)
    old = merged.get(label, ModelRecord(description))
    merged[label] = ModelRecord(description, {**old.parts, **parts})
    return merged


def measured_commit(repo: Path = REPO) -> str:
    """HEAD's short hash, with '+' when tracked files other than the suite's own output
    differ from it; 'unknown' outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".",
                                *(f":!{p}" for p in GENERATED)], cwd=repo,
                               capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def default_label(model: str) -> str:
    """'demo' / 'wide' for the named shapes of ``loragate make-demo``, else the model
    directory's name."""
    from engine.demo_shapes import SHAPES

    marker = Path(model) / "loragate_demo.json"
    if marker.is_file():
        spec = ast.literal_eval(marker.read_text())
        for name, shape in SHAPES.items():
            if spec == asdict(shape):
                return name
    return Path(model).resolve().name


def describe_model(model: str) -> str:
    """One line: family, shape and parameter count, and whether the weights are random."""
    from safetensors import safe_open

    from engine.models.loader import load_hf_config

    config = load_hf_config(model)
    params = 0
    for file in sorted(Path(model).glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            for name in weights.keys():  # noqa: SIM118  (safe_open is not a mapping)
                shape = weights.get_slice(name).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                params += count
    tied = ", tied embeddings" if getattr(config, "tie_word_embeddings", False) else ""
    origin = ("random weights (loragate make-demo)"
              if (Path(model) / "loragate_demo.json").is_file() else "trained weights")
    return (f"{config.model_type}, {params / 1e6:.0f}M parameters, hidden "
            f"{config.hidden_size}, {config.num_hidden_layers} layers, "
            f"{config.num_attention_heads}/{config.num_key_value_heads} heads, vocab "
            f"{config.vocab_size}{tied}; {origin}")
