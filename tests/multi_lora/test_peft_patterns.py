"""rank_pattern and alpha_pattern: some modules of an adapter with a rank and alpha of their
own. The reference is PEFT itself: adapters it saved from such configs, served beside each
other and beside plain ones, give the outputs PEFT computes for them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from peft import PeftModel

from engine.demo_model import make_peft_adapter
from engine.llm_engine import LLMEngine
from engine.models.shape import ModelShape
from lora.adapter import load_adapter
from tests.parity import check_against_reference, load_reference, random_workload, run_workload

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PATTERNED: dict[str, dict[str, Any]] = {
    # Names by their end, a full name, and a regular expression; keys in the order PEFT
    # tries them (the first match wins: layer 1's q_proj is 12 by its full name first).
    "names": dict(rank=4, rank_pattern={"model.layers.1.self_attn.q_proj": 12, "q_proj": 8,
                                        r"layers\.0\.mlp\.(up|down)_proj": 2},
                  alpha_pattern={"v_proj": 3, r".*\.o_proj": 40}),
    "rslora": dict(rank=8, use_rslora=True, rank_pattern={"gate_proj": 16, "k_proj": 1},
                   alpha_pattern={"model.layers.0.self_attn.k_proj": 0.5}),
}


@pytest.fixture(scope="module")
def patterned(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("patterned")
    return {name: make_peft_adapter(tiny_model_dir, root / name, target_modules=ALL,
                                    seed=40 + i, b_scale=0.5, **spec)
            for i, (name, spec) in enumerate(PATTERNED.items())}


def test_patterned_adapters_give_peft_s_outputs(tiny_model_dir: Path,
                                                patterned: dict[str, Path],
                                                adapters: dict[str, Path]) -> None:
    served = {**patterned, "plain": adapters["ad1"]}
    engine = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=64, block_size=16,
                                  max_num_batched_tokens=64, max_num_seqs=8, max_loras=3,
                                  max_lora_rank=16, max_model_len=512)
    for name, path in served.items():
        engine.load_lora(name, str(path))
    items = random_workload(18, seed=11, max_prompt=60, max_output=6, max_arrival_step=8)
    names = [*served, None]
    loras = {w.request_id: names[i % len(names)] for i, w in enumerate(items)}
    done = run_workload(engine, items, logprobs=3, loras=loras)

    peft_model = PeftModel.from_pretrained(load_reference(tiny_model_dir), str(served["plain"]),
                                           adapter_name="plain")
    for name in patterned:
        peft_model.load_adapter(str(served[name]), adapter_name=name)
    peft_model.eval()
    for item in items:
        lora = loras[item.request_id]
        if lora is None:
            with peft_model.disable_adapter():
                check_against_reference(peft_model, item.prompt, done[item.request_id])
        else:
            peft_model.set_adapter(lora)
            check_against_reference(peft_model, item.prompt, done[item.request_id])


def test_each_module_keeps_its_own_rank(patterned: dict[str, Path], shape: ModelShape) -> None:
    adapter = load_adapter("names", patterned["names"], shape.lora_targets(), max_rank=16)
    ranks = {key: a.shape[0] for key, (a, _) in adapter.weights.items()}
    assert (ranks[(1, "q_proj")], ranks[(0, "q_proj")], ranks[(0, "up_proj")],
            ranks[(1, "up_proj")], ranks[(0, "v_proj")]) == (12, 8, 2, 4, 4)
    assert adapter.rank == 12  # the rows of a slot it needs
    with pytest.raises(ValueError, match=r"rank 12 exceeds max_lora_rank 8 \(rank_pattern, "
                                         r"for layer 1 q_proj\)"):
        load_adapter("names", patterned["names"], shape.lora_targets(), max_rank=8)


def _edited(src: Path, where: Path, **changes: Any) -> Path:
    shutil.copytree(src, where)
    config = json.loads((where / "adapter_config.json").read_text())
    (where / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return where


def test_an_alpha_pattern_changes_the_identity(patterned: dict[str, Path], shape: ModelShape,
                                               tmp_path: Path) -> None:
    # Same weights, another scaling for v_proj: other KV, so no prefix-cache block is shared.
    first = load_adapter("names", patterned["names"], shape.lora_targets(), max_rank=16)
    moved = _edited(patterned["names"], tmp_path / "moved",
                    alpha_pattern={"v_proj": 5, r".*\.o_proj": 40})
    second = load_adapter("names", moved, shape.lora_targets(), max_rank=16)
    assert first.digest != second.digest


@pytest.mark.parametrize(("changes", "match"), [
    ({"rank_pattern": ["q_proj", 8]}, r"rank_pattern must be an object"),
    ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\] must be a positive integer"),
    ({"rank_pattern": {"q_proj": "8"}}, r"must be a positive integer, got '8'"),
    ({"rank_pattern": {"q_proj": True}}, r"must be a positive integer, got True"),
    ({"alpha_pattern": {"v_proj": "3"}}, r"alpha_pattern\['v_proj'\] must be a finite number"),
    ({"alpha_pattern": {"(v_proj": 3}}, r"alpha_pattern key '\(v_proj' is not a regular"),
    ({"rank_pattern": {"(a|aa)*c" + "x" * 4100: 8}}, r"of 4108 characters, over 4096"),
    ({"alpha_pattern": {f"{i}" + "x" * 4000: 1 for i in range(17)}},
     r"alpha_pattern's keys hold 68024 characters, over 65536"),
    # Unrolled by a compiler, gigabytes from 30 characters: refused before compiling.
    ({"rank_pattern": {"(?:(?:x{100}){100}){100}": 8}}, r"repeats a part more than 1024"),
    # Python's re (PEFT) reads [[:digit:]] as characters; the regex package as a class.
    ({"alpha_pattern": {r"layers\.1[[:digit:]]\.self_attn\.q_proj": 512}},
     r"Python's re \(PEFT's\) reads as written: Possible nested set"),
    # Backtracks through every split of a name: its groups are 3-10 inside (.*\.)?(KEY)$.
    ({"rank_pattern": {"(.*)(.*)(.*)(.*)(.*)(.*)(.*)(.*)\\10\\9\\8\\7\\6\\5\\4\\3": 8}},
     r"took over 0.5 s"),
    # PEFT builds these modules at its own rank: the file's weights then do not fit.
    ({"rank_pattern": {"q_proj": 4}}, r"layer 0 down_proj has A \(2, \d+\) and B \(\d+, 2\); "
                                      r"the base model and r=4 need A \(4, "),
])
def test_patterns_peft_would_not_take_are_refused(patterned: dict[str, Path],
                                                  shape: ModelShape, tmp_path: Path,
                                                  changes: dict[str, Any], match: str) -> None:
    path = _edited(patterned["names"], tmp_path / "edited", **changes)
    with pytest.raises(ValueError, match=match):
        load_adapter("names", path, shape.lora_targets(), max_rank=16)
