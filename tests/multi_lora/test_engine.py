"""Multi-LoRA in the engine: parity with PEFT, block isolation, scheduling limits, unload while
busy, per-adapter KV pools, offline and async front ends."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
from peft import PeftModel

from engine.llm_engine import LLMEngine
from engine.models.llama import DecoderLayer
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from tests.parity import check_against_reference, load_reference


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
    outs: dict[str, list[int]] = {}
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
    broken = Path(shutil.copytree(adapters["ad1"], tmp_path / "broken"))
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="is corrupt"):
        engine.load_lora("broken", str(broken))
    with pytest.raises(ValueError, match="unknown adapter 'broken'"):
        engine.add_request("x", [5, 6], SamplingParams(), lora="broken")
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("ad0")
    assert engine.list_loras() == []


def test_a_request_whose_logits_are_not_numbers_fails_alone(
        tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    """Weights that overflow in the forward (the loader refuses them; these are given to
    the engine as already validated): the adapter's request ends with an error, the other
    requests of its batch get what they get alone."""
    def run(engine: LLMEngine, loras: dict[str, str | None]) -> dict[str, RequestOutput]:
        for rid, lora in loras.items():
            engine.add_request(rid, [5, 6, 7, 8, 9], SamplingParams(
                max_tokens=6, temperature=0 if rid != "seeded" else 1.0, seed=3,
                ignore_eos=True), lora=lora)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return done

    engine = _engine(tiny_model_dir, {"ad0": adapters["ad0"]})
    good = engine.validate_lora("ad1", str(adapters["ad1"]))
    engine.add_lora(dataclasses.replace(good, name="overflow", weights={
        key: (a, b * 1e30) for key, (a, b) in good.weights.items()}))
    mixed = run(engine, {"base": None, "ad0": "ad0", "seeded": None,
                         "overflow": "overflow"})
    assert mixed["overflow"].error is not None and "NaN" in mixed["overflow"].error
    alone = run(_engine(tiny_model_dir, {"ad0": adapters["ad0"]}),
                {"base": None, "ad0": "ad0", "seeded": None})
    for rid, out in alone.items():
        assert mixed[rid].error is None and mixed[rid].token_ids == out.token_ids


def test_adapter_file_changed_after_registration_fails_its_requests(
        tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    path = Path(shutil.copytree(adapters["ad0"], tmp_path / "moving"))
    engine = _engine(tiny_model_dir, {"moving": path}, max_cpu_loras=1)
    engine.load_lora("filler", str(adapters["ad1"]))  # pushes "moving" out of the CPU tier
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # another adapter
        shutil.copy(adapters["ad4"] / name, path / name)
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
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer, DecoderLayer) and layer.self_attn.qkv_proj.lora_a is None


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
            adapter = await engine.load_adapter("ad3", str(adapters["ad3"]))
            assert adapter.rank == 32
            with pytest.raises(ValueError, match="unknown adapter 'nope'"):
                async for _ in engine.generate("same prompt", params, lora="nope"):
                    pass
            outs = [o async for o in engine.generate("same prompt", params, lora="ad3")]
            infos = await engine.adapters()
            assert [(i.name, i.running_requests) for i in infos] == [("ad3", 0)]
            return outs[-1].token_ids

        assert asyncio.run(main()) == offline[0].token_ids
    finally:
        engine.shutdown()
