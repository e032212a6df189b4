"""Multi-LoRA: adapter validation, slot manager, scheduling limits, parity with PEFT."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from peft import PeftModel

from engine.demo_model import make_peft_adapter
from engine.llm_engine import LLMEngine
from engine.models.loader import load_hf_config
from engine.models.shape import ModelShape
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from lora.adapter import load_adapter
from lora.manager import LoraManager
from tests.parity import check_against_reference, load_reference

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (rank, targets, rslora) of the eight test adapters: ranks 4-32, mixed targets.
ADAPTER_SPECS = [
    (4, ("q_proj", "v_proj"), False),
    (8, ALL, False),
    (16, ("gate_proj", "up_proj", "down_proj"), True),
    (32, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
    (4, ALL, True),
    (8, ("o_proj", "down_proj"), False),
    (16, ALL, False),
    (32, ("v_proj", "up_proj"), False),
]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        f"ad{i}": make_peft_adapter(tiny_model_dir, root / f"ad{i}", rank=rank,
                                    target_modules=targets, seed=100 + i, use_rslora=rslora,
                                    b_scale=0.5)
        for i, (rank, targets, rslora) in enumerate(ADAPTER_SPECS)
    }


@pytest.fixture(scope="module")
def shape(tiny_model_dir: Path) -> ModelShape:
    return ModelShape.from_hf_config(load_hf_config(str(tiny_model_dir)))


# --------------------------------------------------------------------------- validation
def test_valid_adapter_loads_with_identity(adapters: dict[str, Path], shape: ModelShape
                                           ) -> None:
    a = load_adapter("ad2", adapters["ad2"], shape, max_rank=32)
    assert a.rank == 16 and a.use_rslora and a.target_modules == {"gate_proj", "up_proj",
                                                                   "down_proj"}
    assert len(a.weights) == 2 * 3  # 2 layers x 3 modules
    again = load_adapter("ad2", adapters["ad2"], shape, max_rank=32)
    assert again.digest == a.digest
    other = load_adapter("ad2", adapters["ad6"], shape, max_rank=32)
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
    ("bias", "bias='all' is not supported"),
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
        _edit_config(path, bias="all")
    elif breakage == "rank_mismatch":
        _edit_config(path, r=16)
    elif breakage == "not_lora":
        _edit_config(path, peft_type="IA3")
    max_rank = 16 if breakage == "rank_over_cap" else 64
    with pytest.raises(ValueError, match=match):
        load_adapter("broken", path, shape, max_rank=max_rank)


def test_adapter_for_another_base_model_is_refused(tiny_model_dir: Path, shape: ModelShape,
                                                   tmp_path: Path) -> None:
    from engine.demo_model import DemoModelSpec, make_demo_model

    other = make_demo_model(tmp_path / "other", DemoModelSpec(
        vocab_size=512, hidden_size=96, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2))
    path = make_peft_adapter(other, tmp_path / "foreign", rank=4, target_modules=("q_proj",),
                             seed=1)
    with pytest.raises(ValueError, match="the base model and r=4 need A"):
        load_adapter("foreign", path, shape, max_rank=16)


def test_unsupported_target_module_is_refused(tiny_model_dir: Path, shape: ModelShape,
                                              tmp_path: Path) -> None:
    path = make_peft_adapter(tiny_model_dir, tmp_path / "head", rank=4,
                             target_modules=("q_proj", "lm_head"), seed=2)
    with pytest.raises(ValueError, match="unexpected weight"):
        load_adapter("head", path, shape, max_rank=16)


# ------------------------------------------------------------------------------ manager
def _manager(shape: ModelShape, adapters: dict[str, Path], max_loras: int = 2,
             max_cpu: int = 8) -> LoraManager:
    manager = LoraManager(shape, max_loras=max_loras, max_cpu_loras=max_cpu, max_rank=32)
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


# ------------------------------------------------------------------------------ engine
def _engine(tiny_model_dir: Path, adapters: dict[str, Path], **overrides: object
            ) -> LLMEngine:
    config: dict[str, object] = dict(num_kv_blocks=48, block_size=16, max_num_batched_tokens=64,
                                     max_num_seqs=12, max_loras=4, max_lora_rank=32,
                                     max_model_len=512)
    config.update(overrides)
    engine = LLMEngine.from_model(str(tiny_model_dir), **config)
    for name, path in adapters.items():
        engine.load_lora(name, str(path))
    return engine


def test_random_multi_lora_workload_matches_peft(tiny_model_dir: Path,
                                                 adapters: dict[str, Path]) -> None:
    engine = _engine(tiny_model_dir, adapters, num_kv_blocks=24)  # forces preemption
    rng = random.Random(5)
    docs = [[rng.randrange(5, 512) for _ in range(rng.randint(20, 90))] for _ in range(3)]
    names: list[str | None] = [*adapters, None]
    items = []
    for i in range(64):
        prompt = rng.choice(docs) + [rng.randrange(5, 512) for _ in range(rng.randint(1, 60))]
        items.append((f"m{i}", prompt, rng.choice(names), rng.randint(1, 12),
                      rng.randint(0, 30)))
    pending = sorted(items, key=lambda it: it[4])
    done: dict[str, RequestOutput] = {}
    distinct_per_step: list[int] = []
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][4] <= step:
            rid, prompt, lora, max_tokens, _ = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=3), lora=lora)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        distinct_per_step.append(len({r.lora_name for r in engine.scheduler.running
                                      if r.lora_name is not None}))
        step += 1

    stats = engine.stats()
    assert max(distinct_per_step) <= 4
    assert stats.num_preemptions > 0 and stats.prefix_cache.hit_tokens > 0
    assert stats.kv_blocks_used == 0
    assert all(info.running_requests == 0 for info in engine.list_loras())

    base = load_reference(tiny_model_dir)
    peft_model = PeftModel.from_pretrained(base, str(adapters["ad0"]), adapter_name="ad0")
    for name, path in adapters.items():
        if name != "ad0":
            peft_model.load_adapter(str(path), adapter_name=name)
    peft_model.eval()
    for rid, prompt, lora, _, _ in items:
        if lora is None:
            with peft_model.disable_adapter():
                check_against_reference(peft_model, prompt, done[rid])
        else:
            peft_model.set_adapter(lora)
            check_against_reference(peft_model, prompt, done[rid])


def test_adapter_changes_output_and_never_shares_blocks(tiny_model_dir: Path,
                                                        adapters: dict[str, Path]) -> None:
    engine = _engine(tiny_model_dir, adapters)
    prompt = list(range(10, 90))
    outs = {}
    for lora in (None, "ad1", "ad6", "ad1"):
        engine.add_request(f"{lora}-{len(outs)}", prompt, SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True), lora=lora)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.token_ids
    assert len({tuple(v) for v in outs.values()}) == 3  # ad1 twice gives the same tokens
    # The second ad1 request hit ad1's blocks (64 of 80 prompt tokens): the only hit.
    assert engine.stats().prefix_cache.hit_tokens == 64


def test_skewed_mix_does_not_starve_cold_adapter(tiny_model_dir: Path,
                                                 adapters: dict[str, Path]) -> None:
    engine = _engine(tiny_model_dir, adapters, max_loras=1, lora_starvation_steps=4,
                     max_num_seqs=4, num_kv_blocks=64)
    engine.add_request("cold", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True),
                       lora="ad2")
    finished_at: dict[str, int] = {}
    step = 0
    # A hot adapter with a new request every step would hold the only slot forever.
    while "cold" not in finished_at and step < 200:
        engine.add_request(f"hot{step}", [8, 9, 10], SamplingParams(max_tokens=3,
                                                                    ignore_eos=True),
                           lora="ad1")
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = step
        step += 1
    assert "cold" in finished_at and finished_at["cold"] < 30
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    assert engine.stats().kv_blocks_used == 0


def test_unload_while_busy_and_bad_adapter_keep_engine_serving(
        tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    engine = _engine(tiny_model_dir, {"ad0": adapters["ad0"]})
    engine.add_request("busy", [5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True),
                       lora="ad0")
    engine.step()
    with pytest.raises(ValueError, match="in use by 1 request"):
        engine.remove_lora("ad0")
    broken = _broken_copy(adapters["ad1"], tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="is corrupt"):
        engine.load_lora("broken", str(broken))
    with pytest.raises(ValueError, match="unknown adapter 'broken'"):
        engine.add_request("x", [5, 6], SamplingParams(), lora="broken")
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("ad0")
    assert engine.list_loras() == []


def test_adapter_file_changed_after_registration_fails_its_requests(
        tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    path = _broken_copy(adapters["ad0"], tmp_path / "moving")
    engine = _engine(tiny_model_dir, {"moving": path}, max_cpu_loras=1)
    engine.load_lora("filler", str(adapters["ad1"]))  # pushes "moving" out of the CPU tier
    shutil.copy(adapters["ad4"] / "adapter_model.safetensors",
                path / "adapter_model.safetensors")
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2), lora="moving")
    assert engine.step() == []  # starts the background disk load; the request waits
    assert engine.lora is not None
    engine.lora.wait_for_loads(timeout=60)
    outs = engine.step()
    final = outs[0] if outs else None
    assert final is not None and final.finish_reason == "error"
    assert final.error is not None and "changed on disk" in final.error
    assert engine.stats().kv_blocks_used == 0


def test_lora_disabled_refuses_adapter_requests(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=16, max_loras=0)
    with pytest.raises(ValueError, match="LoRA is disabled"):
        engine.add_request("x", [5, 6], SamplingParams(), lora="anything")
    # No slot buffers at all: the base model runs exactly as without LoRA support.
    assert engine.runner.lora_slots is None
    assert engine.runner.model.model.layers[0].self_attn.q_proj.lora_a is None


def test_capped_adapter_pool_preempts_its_own_requests_first(
        tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    # ad0's pool may hold 4 of the 16 blocks (64 tokens).
    engine = _engine(tiny_model_dir, {"ad0": adapters["ad0"]}, num_kv_blocks=16,
                     kv_pool_shares=(("ad0", 0.0, 0.25),))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("ad0-old", list(range(5, 25)), params, lora="ad0")
    engine.add_request("ad0-new", list(range(30, 50)), params, lora="ad0")
    engine.add_request("base-newest", list(range(60, 80)), params)
    preempted: list[str] = []
    while engine.has_unfinished_requests():
        before = engine.scheduler.num_preemptions
        engine.step()
        if engine.scheduler.num_preemptions > before:
            preempted.append(next(r.request_id for r in engine.scheduler.waiting
                                  if r.num_preemptions))
        assert engine.stats().kv_pools["ad0"].used_blocks <= 4
    # At 32 tokens ad0-old needs a third block while ad0 is at its cap: the newest ad0
    # request goes, never the newer base request.
    assert preempted and set(preempted) == {"ad0-new"}
    pools = engine.stats().kv_pools
    assert pools["ad0"].cap_blocks == 4 and pools["base"].cap_blocks == 16
    assert pools["ad0"].used_blocks == pools["base"].used_blocks == 0


def test_offline_and_async_front_ends_take_adapters(tiny_model_dir: Path,
                                                    adapters: dict[str, Path]) -> None:
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm import LLM

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=32, max_lora_rank=32)
    llm.load_lora("ad3", str(adapters["ad3"]))
    offline = llm.generate(["same prompt"] * 2, params, lora=["ad3", None], use_tqdm=False)
    assert offline[0].token_ids != offline[1].token_ids

    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32,
                                                  max_lora_rank=32))
    try:
        async def main() -> list[int]:
            adapter = await engine.load_lora("ad3", str(adapters["ad3"]))
            assert adapter.rank == 32
            with pytest.raises(ValueError, match="unknown adapter 'nope'"):
                async for _ in engine.generate("same prompt", params, lora="nope"):
                    pass
            outs = [o async for o in engine.generate("same prompt", params, lora="ad3")]
            infos = await engine.call(engine.engine.list_loras)
            assert [(i.name, i.running_requests) for i in infos] == [("ad3", 0)]
            return outs[-1].token_ids

        assert asyncio.run(main()) == offline[0].token_ids
    finally:
        engine.shutdown()
