"""The sampling defaults a model ships in its ``generation_config.json``.

Model authors put the sampling they recommend there (Qwen2.5-Instruct: temperature 0.7,
top_p 0.8, top_k 20, repetition_penalty 1.05). vLLM applies those values to every request
that leaves the field unset (its ``--generation-config auto``, the default); so does
loragate, so that a request without a temperature samples the same way behind either server.
Only the keys written in the file count: transformers' GenerationConfig would fill in its own
defaults (top_k 50) that the model's authors never chose.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingDefaults:
    """The model's recommended sampling; None where it recommends nothing (the OpenAI
    defaults apply: temperature 1, top_p 1, no top-k, min-p or repetition penalty)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """0: no top-k."""
    min_p: float | None = None
    repetition_penalty: float | None = None

    def to_json(self) -> dict[str, float]:
        """The fields that are set (what EngineState carries to the gateway)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def sampling_params(self) -> SamplingParams:
        """SamplingParams' defaults with these over them."""
        base = SamplingParams()
        return replace(
            base,
            temperature=base.temperature if self.temperature is None else self.temperature,
            top_p=base.top_p if self.top_p is None else self.top_p,
            top_k=base.top_k if self.top_k is None else self.top_k,
            min_p=base.min_p if self.min_p is None else self.min_p,
            repetition_penalty=(base.repetition_penalty if self.repetition_penalty is None
                                else self.repetition_penalty))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SamplingDefaults:
        """The valid known fields of ``data``; anything else is dropped with a warning (an
        engine's answer, or a model's file, must not break requests that do not use it)."""
        values: dict[str, Any] = {}
        for name in (f.name for f in fields(cls)):
            if name not in data:
                continue
            value = data[name]
            if _valid(name, value):
                values[name] = int(value) if name == "top_k" else float(value)
            else:
                log.warning("ignoring the sampling default %s=%r: out of range", name, value)
        return cls(**values)


def _valid(name: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if name == "temperature":
        return 0 <= value <= 2
    if name == "top_p":
        return 0 < value <= 1
    if name == "top_k":
        return value == int(value) and value >= -1
    if name == "min_p":
        return 0 <= value <= 1
    return 0 < value <= 2  # repetition_penalty


def read_sampling_defaults(model_dir: str | Path) -> SamplingDefaults:
    """The sampling keys written in ``model_dir/generation_config.json`` (none if the file
    is missing or unreadable). top_k -1 (vLLM's "off") reads as 0."""
    path = Path(model_dir) / "generation_config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return SamplingDefaults()
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return SamplingDefaults()
    if not isinstance(data, dict):
        return SamplingDefaults()
    defaults = SamplingDefaults.from_json(data)
    if defaults.top_k is not None and defaults.top_k < 0:
        defaults = replace(defaults, top_k=0)
    return defaults
