"""`loragate make-demo`: a named shape gives the sizes, each size flag given overrides one."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.cli import build_parser, main


def test_wide_shape_with_an_override_writes_that_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["make-demo", str(tmp_path / "m"), "--shape", "wide", "--num-layers", "1",
         "--vocab-size", "400", "--adapters", "0"])
    assert args.func(args) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    # From the wide shape: head_dim 128, GQA 4:1, MLP 3.5x hidden.
    assert (config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (1024, 8, 2, 3584)
    # From the flags.
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] >= 400
    assert not (tmp_path / "m" / "adapters").exists()


def test_without_seed_the_shape_seed_makes_the_adapters(tmp_path: Path) -> None:
    """No --seed: the adapters take the shape's seed (this crashed after writing the model)."""
    tiny = ["--vocab-size", "400", "--hidden-size", "32", "--intermediate-size", "64",
            "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1"]
    for run in ("a", "b"):
        assert main(["make-demo", str(tmp_path / run), *tiny, "--adapters", "1"]) == 0
    weights = [(tmp_path / run / "adapters" / "demo-0" / "adapter_model.safetensors")
               .read_bytes() for run in ("a", "b")]
    assert weights[0] == weights[1]  # seeded: the same adapter twice
