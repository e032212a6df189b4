"""Multi-LoRA: adapter validation (clear refusals) and the slot / CPU-tier manager."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.demo_model import make_peft_adapter
from engine.models.shape import ModelShape
from lora.adapter import load_adapter
from lora.manager import LoraManager


# --------------------------------------------------------------------------- validation
def test_valid_adapter_loads_with_identity(adapters: dict[str, Path], shape: ModelShape
                                           ) -> None:
    a = load_adapter("ad2", adapters["ad2"], shape.lora_targets(), max_rank=32)
    assert a.rank == 16 and a.use_rslora and a.target_modules == {"gate_proj", "up_proj",
                                                                   "down_proj"}
    assert len(a.weights) == 2 * 3  # 2 layers x 3 modules
    again = load_adapter("ad2", adapters["ad2"], shape.lora_targets(), max_rank=32)
    assert again.digest == a.digest
    other = load_adapter("ad2", adapters["ad6"], shape.lora_targets(), max_rank=32)
    assert other.digest != a.digest


def _broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("breakage", "match"), [
    ("missing_config", "has no adapter_config.json"),
    ("missing_weights", "has no adapter_model.safetensors"),
    ("corrupt_weights", "is corrupt"),
    ("bad_json", "is not valid JSON"),
    ("dora", "use_dora=True is a LoRA variant loragate does not implement"),
    ("bias", "bias='some' is not one of PEFT's"),
    ("bias_weights", r"unexpected weight '.*q_proj\.bias'"),
    ("pickled", "adapter_model.bin is not read"),
    ("a_file", "is not a directory"),
    ("rank_over_cap", "rank 32 exceeds max_lora_rank 16"),
    ("rank_mismatch", r"has A \(32, 64\)"),
    ("not_lora", "peft_type 'IA3' is not supported"),
])
def test_bad_adapters_are_refused(adapters: dict[str, Path], shape: ModelShape, tmp_path: Path,
                                  breakage: str, match: str) -> None:
    path = _broken_copy(adapters["ad3"], tmp_path / "broken")
    if breakage == "missing_config":
        (path / "adapter_config.json").unlink()
    elif breakage == "missing_weights":
        (path / "adapter_model.safetensors").unlink()
    elif breakage == "corrupt_weights":
        data = (path / "adapter_model.safetensors").read_bytes()
        (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    elif breakage == "bad_json":
        (path / "adapter_config.json").write_text("{not json")
    elif breakage == "dora":
        _edit_config(path, use_dora=True)
    elif breakage == "bias":
        _edit_config(path, bias="some")
    elif breakage == "bias_weights":  # trained base biases (a model that has them)
        _edit_config(path, bias="lora_only")
        tensors = load_file(path / "adapter_model.safetensors")
        tensors["base_model.model.model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        save_file(tensors, path / "adapter_model.safetensors")
    elif breakage == "pickled":
        (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    elif breakage == "a_file":
        path = path / "adapter_config.json"
    elif breakage == "rank_mismatch":
        _edit_config(path, r=16)
    elif breakage == "not_lora":
        _edit_config(path, peft_type="IA3")
    max_rank = 16 if breakage == "rank_over_cap" else 64
    with pytest.raises(ValueError, match=match):
        load_adapter("broken", path, shape.lora_targets(), max_rank=max_rank)


def test_adapter_for_another_base_model_is_refused(tiny_model_dir: Path, shape: ModelShape,
                                                   tmp_path: Path) -> None:
    from engine.demo_model import make_demo_model
    from engine.demo_shapes import DemoModelSpec

    other = make_demo_model(tmp_path / "other", DemoModelSpec(
        vocab_size=512, hidden_size=96, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2))
    path = make_peft_adapter(other, tmp_path / "foreign", rank=4, target_modules=("q_proj",),
                             seed=1)
    with pytest.raises(ValueError, match="the base model and r=4 need A"):
        load_adapter("foreign", path, shape.lora_targets(), max_rank=16)


def test_unsupported_target_module_is_refused(tiny_model_dir: Path, shape: ModelShape,
                                              tmp_path: Path) -> None:
    path = make_peft_adapter(tiny_model_dir, tmp_path / "head", rank=4,
                             target_modules=("q_proj", "lm_head"), seed=2)
    with pytest.raises(ValueError, match="unexpected weight"):
        load_adapter("head", path, shape.lora_targets(), max_rank=16)


# ------------------------------------------------------------------------------ manager
def _manager(shape: ModelShape, adapters: dict[str, Path], max_loras: int = 2,
             max_cpu: int = 8) -> LoraManager:
    manager = LoraManager(shape.lora_targets(), max_loras=max_loras, max_cpu_loras=max_cpu,
                          max_rank=32)
    for name, path in adapters.items():
        manager.add(manager.validate(name, str(path)))
    return manager


def test_slots_are_lru_over_idle_adapters(shape: ModelShape, adapters: dict[str, Path]
                                          ) -> None:
    m = _manager(shape, adapters)
    got0 = m.acquire("ad0")
    got1 = m.acquire("ad1")
    assert got0 is not None and got1 is not None
    assert (got0[0], got1[0]) == (0, 1) and got0[1] is not None
    assert m.acquire("ad2") is None  # both slots busy
    m.release("ad0")
    got2 = m.acquire("ad2")
    assert got2 is not None and got2[0] == 0  # ad0's slot, now idle, is reused
    again = m.acquire("ad1")
    assert again == (1, None)  # resident: no copy needed
    m.release("ad1")
    m.release("ad1")
    m.release("ad2")
    # ad2 (slot 0) was used after ad1's first acquire but ad1 was touched last: slot 0 is LRU.
    got3 = m.acquire("ad3")
    assert got3 is not None and got3[0] == 0
    assert not m.is_resident("ad2") and m.is_resident("ad1")


def test_pinned_adapter_keeps_its_slot(shape: ModelShape, adapters: dict[str, Path]) -> None:
    m = _manager(shape, adapters)
    m.pin("ad0")
    assert m.acquire("ad0") is not None
    m.release("ad0")
    assert m.acquire("ad1") is not None
    m.release("ad1")
    got = m.acquire("ad2")
    assert got is not None and got[0] == 1  # ad0 pinned: ad1's slot goes
    assert m.is_resident("ad0")
    m.pin("ad1")
    with pytest.raises(ValueError, match="all 2 slots are pinned"):
        m.pin("ad2")


def test_cpu_tier_is_lru_and_reloads_in_background(shape: ModelShape,
                                                   adapters: dict[str, Path]) -> None:
    m = _manager(shape, adapters, max_loras=1, max_cpu=2)
    # Only the last two added remain in the CPU tier.
    assert [i.name for i in m.infos() if i.in_cpu] == ["ad6", "ad7"]
    assert m.acquire("ad0") is None  # must be read from disk first
    while m.acquire("ad0") is None:
        m.poll()
    assert m.is_resident("ad0")
    m.release("ad0")


def test_unload_refused_while_running(shape: ModelShape, adapters: dict[str, Path]) -> None:
    m = _manager(shape, adapters)
    assert m.acquire("ad0") is not None
    with pytest.raises(ValueError, match="in use by 1 running request"):
        m.remove("ad0")
    m.release("ad0")
    m.remove("ad0")
    with pytest.raises(ValueError, match="unknown adapter 'ad0'"):
        m.identity("ad0")


def _poison(path: Path, value: float) -> None:
    """Set one element of the first lora_B in the weights file to value."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = value
    save_file(tensors, str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(adapters: dict[str, Path], shape: ModelShape,
                                        tmp_path: Path, value: float) -> None:
    path = _broken_copy(adapters["ad0"], tmp_path / "poisoned")
    _poison(path, value)
    with pytest.raises(ValueError, match="lora_B holds NaN or infinite values"):
        load_adapter("poisoned", path, shape.lora_targets(), max_rank=32)


@pytest.mark.parametrize("alpha", [-1e30, 1e9])
def test_alpha_that_overflows_the_forward_is_refused(adapters: dict[str, Path],
                                                     shape: ModelShape, tmp_path: Path,
                                                     alpha: float) -> None:
    """Finite weights, a finite scaling, yet outputs of 1e27: NaN logits downstream."""
    path = _broken_copy(adapters["ad0"], tmp_path / "alpha")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": alpha}))
    with pytest.raises(ValueError, match=r"changes the base weights by up to .* over 10000"):
        load_adapter("alpha", path, shape.lora_targets(), max_rank=32)


def test_an_alpha_whose_scaling_overflows_names_alpha(adapters: dict[str, Path],
                                                     shape: ModelShape, tmp_path: Path) -> None:
    path = _broken_copy(adapters["ad0"], tmp_path / "alpha")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1e300}))
    with pytest.raises(ValueError, match=r"lora_B holds NaN or infinite values once scaled "
                                         r"by .* \(check lora_alpha\)"):
        load_adapter("alpha", path, shape.lora_targets(), max_rank=32)


@pytest.mark.parametrize("alpha", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_alpha_is_refused(adapters: dict[str, Path], shape: ModelShape,
                                     tmp_path: Path, alpha: str) -> None:
    path = _broken_copy(adapters["ad0"], tmp_path / "alpha")
    text = (path / "adapter_config.json").read_text()
    config = json.loads(text)
    config["lora_alpha"] = "ALPHA"
    (path / "adapter_config.json").write_text(json.dumps(config).replace('"ALPHA"', alpha))
    with pytest.raises(ValueError, match="lora_alpha must be finite"):
        load_adapter("alpha", path, shape.lora_targets(), max_rank=32)


@pytest.mark.parametrize(("content", "match"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"r": 4, "note": "\xff\xfe"}', "is not UTF-8"),
    (b'{"r": ' + b"9" * 5000 + b"}", "is not valid JSON"),
], ids=["deep", "latin1", "huge-int"])
def test_hostile_configs_are_refused_with_value_error(adapters: dict[str, Path],
                                                      shape: ModelShape, tmp_path: Path,
                                                      content: bytes, match: str) -> None:
    path = _broken_copy(adapters["ad0"], tmp_path / "hostile")
    (path / "adapter_config.json").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_adapter("hostile", path, shape.lora_targets(), max_rank=32)


def test_load_error_clears_when_the_files_are_repaired(shape: ModelShape,
                                                       adapters: dict[str, Path],
                                                       tmp_path: Path) -> None:
    path = _broken_copy(adapters["ad0"], tmp_path / "flaky")
    good = (path / "adapter_model.safetensors").read_bytes()
    m = LoraManager(shape.lora_targets(), max_loras=1, max_cpu_loras=1, max_rank=32,
                    error_recheck_s=0.0)
    m.add(m.validate("flaky", str(path)))
    m.add(m.validate("other", str(adapters["ad1"])))  # pushes "flaky" out of the CPU tier
    (path / "adapter_model.safetensors").write_bytes(good[: len(good) // 2])
    assert m.acquire("flaky") is None  # starts the disk load, which fails
    m.wait_for_loads(timeout=60)
    m.poll()
    assert "is corrupt" in m.load_errors["flaky"]
    assert m.acquire("flaky") is None
    m.poll()
    assert "flaky" in m.load_errors  # files unchanged: the error stays, no reload loop
    (path / "adapter_model.safetensors").write_bytes(good)  # repaired, same name and content
    m.poll()
    assert m.load_errors == {}
    assert m.acquire("flaky") is None  # reloads from disk
    m.wait_for_loads(timeout=60)
    m.poll()
    got = m.acquire("flaky")
    assert got is not None and got[1] is not None and got[1].name == "flaky"


def _without_targets(path: Path) -> Path:
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["target_modules"] = None
    config_file.write_text(json.dumps(config))
    return path


def test_a_config_without_target_modules_targets_peft_defaults(
        tiny_model_dir: Path, shape: ModelShape, tmp_path: Path) -> None:
    # PEFT then targets the model type's defaults (q_proj and v_proj for Llama) and ignores
    # any other weight in the file: such weights would be served here and not under PEFT.
    plain = make_peft_adapter(tiny_model_dir, tmp_path / "qv", rank=4,
                              target_modules=("q_proj", "v_proj"), seed=3)
    served = load_adapter("qv", _without_targets(plain), shape.lora_targets(), max_rank=16)
    assert {module for _, module in served.weights} == {"q_proj", "v_proj"}
    wider = make_peft_adapter(tiny_model_dir, tmp_path / "qvd", rank=4,
                              target_modules=("q_proj", "v_proj", "down_proj"), seed=3)
    with pytest.raises(ValueError, match=r"down_proj, which adapter_config.json does not"):
        load_adapter("qvd", _without_targets(wider), shape.lora_targets(), max_rank=16)


def test_peft_default_targets_are_peft_s_own() -> None:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    from engine.models.shape import SUPPORTED_MODEL_TYPES
    from lora.peft_targets import PEFT_DEFAULT_TARGETS

    assert set(PEFT_DEFAULT_TARGETS) == set(SUPPORTED_MODEL_TYPES)
    for model_type, modules in PEFT_DEFAULT_TARGETS.items():
        assert list(modules) == TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type]


def test_switches_peft_resets_for_linear_layers_change_nothing(
        adapters: dict[str, Path], shape: ModelShape, tmp_path: Path) -> None:
    # PEFT turns fan_in_fan_out off for nn.Linear; bias "lora_only" on a model without
    # biases saves none: the adapter is the plain one.
    plain = load_adapter("ad3", adapters["ad3"], shape.lora_targets(), max_rank=64)
    path = _broken_copy(adapters["ad3"], tmp_path / "switches")
    _edit_config(path, fan_in_fan_out=True, bias="lora_only")
    switched = load_adapter("ad3", path, shape.lora_targets(), max_rank=64)
    assert switched.weights.keys() == plain.weights.keys()
    assert all(torch.equal(switched.weights[k][i], plain.weights[k][i])
               for k in plain.weights for i in (0, 1))
