"""An adapter's config decides which of its file's weights PEFT uses (target_modules as names,
a pattern or "all-linear", layers_to_transform, exclude_modules); loragate serves an adapter
only when PEFT would use every weight in its file, and refuses it otherwise. The reference is
PEFT itself: the modules it wraps when it builds the model from the same config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from engine.demo_model import make_peft_adapter
from engine.models.shape import ModelShape
from lora.adapter import load_adapter

CONFIG_EDITS: dict[str, dict[str, Any]] = {
    "as-saved": {},
    "fewer-names": {"target_modules": ["q_proj"]},
    "full-names": {"target_modules": [f"model.layers.{i}.self_attn.{m}_proj"
                                      for i in (0, 1) for m in "qv"]},
    "one-layer": {"layers_to_transform": [0]},
    "one-layer-int": {"layers_to_transform": 1},
    "both-layers": {"layers_to_transform": [0, 1], "layers_pattern": "layers"},
    "pattern": {"target_modules": r".*\.(q|v)_proj"},
    "narrow-pattern": {"target_modules": r".*\.q_proj"},
    "pattern-with-layers": {"target_modules": r".*_proj", "layers_to_transform": [0]},
    "all-linear-with-layers": {"target_modules": "all-linear", "layers_to_transform": [0]},
    "pattern-without-layers": {"layers_pattern": "layers"},
    "excluded": {"exclude_modules": ["v_proj"]},
    "excluded-pattern": {"exclude_modules": r".*layers\.1\..*"},
    "all-linear": {"target_modules": "all-linear"},
}


@pytest.fixture(scope="module")
def saved(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("targets") / "qv",
                             rank=4, target_modules=("q_proj", "v_proj"), seed=7)


def _edited(saved: Path, where: Path, edit: dict[str, Any]) -> Path:
    shutil.copytree(saved, where)
    config = json.loads((where / "adapter_config.json").read_text())
    (where / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    return where


def _peft_uses_every_weight(tiny_model_dir: Path, adapter: Path) -> bool | None:
    """Whether PEFT, building the model from this config, wraps every module the file holds
    weights for (the others it would load as unexpected keys, and ignore); None when PEFT
    refuses the config itself."""
    try:
        config = LoraConfig.from_pretrained(str(adapter))
    except ValueError:
        return None
    base = LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    wrapped = {name.removeprefix("base_model.model.") for name, module in
               get_peft_model(base, config).named_modules() if hasattr(module, "lora_A")}
    in_file = {key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
               for key in load_file(str(adapter / "adapter_model.safetensors"))}
    return in_file <= wrapped


@pytest.mark.parametrize("edit", CONFIG_EDITS, ids=list(CONFIG_EDITS))
def test_an_adapter_is_served_exactly_when_peft_uses_all_its_weights(
        tiny_model_dir: Path, shape: ModelShape, saved: Path, tmp_path: Path,
        edit: str) -> None:
    adapter = _edited(saved, tmp_path / edit, CONFIG_EDITS[edit])
    expected = _peft_uses_every_weight(tiny_model_dir, adapter)
    try:
        load_adapter(edit, adapter, shape.lora_targets(), max_rank=16)
    except ValueError as exc:
        assert expected is not True, exc
        if expected is False:
            assert "which adapter_config.json does not target" in str(exc)
    else:
        assert expected


@pytest.mark.parametrize(("edit", "match"), [
    ({"target_modules": "(.*)(.*)(.*)(.*)(.*)(.*)(.*)(.*)\\8\\7\\6\\5\\4\\3\\2\\1"},
     "took over"),
    ({"target_modules": "(unclosed"}, "is not a regular expression"),
    ({"target_modules": "(?:(?:x{100}){100}){100}"}, "repeats a part more than 1024 times"),
    ({"target_modules": ["q_proj"], "layers_to_transform": [0],
      "layers_pattern": "(?:(?:x{100}){100}){100}"}, "layers_pattern .* repeats a part"),
    ({"target_modules": {"q_proj": 1}}, "must be a list of module names"),
    ({"layers_to_transform": [0, "1"]}, "layers_to_transform must be"),
    ({"layers_to_transform": [0], "layers_pattern": 5}, "layers_pattern must be"),
], ids=["slow-pattern", "bad-pattern", "repeat-bomb", "layers-repeat-bomb", "object",
        "layer-string", "pattern-number"])
def test_configs_peft_would_not_take_are_refused(shape: ModelShape, saved: Path,
                                                 tmp_path: Path, edit: dict[str, Any],
                                                 match: str) -> None:
    adapter = _edited(saved, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=match):
        load_adapter("bad", adapter, shape.lora_targets(), max_rank=16)
