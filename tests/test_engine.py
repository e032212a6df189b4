"""LLMEngine / LLM behaviour: bad input, aborts, sampling, stops, metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=48,
                                max_num_batched_tokens=64, max_model_len=512)


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return done


def _steps_until(engine: LLMEngine, request_id: str, min_computed: int) -> None:
    request = engine.scheduler.requests[request_id]
    while request.num_computed_tokens < min_computed:
        engine.step()


@pytest.mark.parametrize(("prompt", "params", "match"), [
    ([], SamplingParams(), "prompt is empty"),
    ("", SamplingParams(), "prompt is empty"),
    ([1] * 500, SamplingParams(max_tokens=20), "exceeds the model's context of 512"),
    ([9999], SamplingParams(), "out of range"),
])
def test_bad_requests_are_refused_before_scheduling(
        engine: LLMEngine, prompt: list[int] | str, params: SamplingParams, match: str) -> None:
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert "bad" not in engine.scheduler.requests
    done = _drain(engine)
    assert list(done) == ["ok"] and len(done["ok"].token_ids) == 4


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_tokens": 0}, r"max_tokens must be an integer in \[1, 2147483647\], got 0"),
    ({"max_tokens": 2**31}, "max_tokens must be an integer in"),
    ({"max_tokens": True}, "max_tokens must be an integer in"),
    ({"temperature": -0.5}, "temperature must be a finite number >= 0, got -0.5"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_p": float("nan")}, r"top_p must be in \(0, 1\], got nan"),
    ({"top_k": 2**63}, "top_k must be an integer in"),
    ({"top_k": -2}, "top_k must be an integer in"),
    ({"seed": 2**64}, r"seed must be an integer in \[0, 2\*\*64\)"),
    ({"seed": -2**63 - 1}, "seed must be an integer in"),
    ({"seed": -1}, "seed must be an integer in"),
    ({"logprobs": 21}, "logprobs must be an integer between 0 and 20"),
    ({"stop": ["x"] * 65}, "stop must be at most 64"),
    ({"stop": ["x" * 1025]}, "stop must be at most 64"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids must be integers"),
    ({"n": 2}, "n must be 1"),
])
def test_bad_sampling_params(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_request_larger_than_cache_is_refused(tiny_model_dir: Path) -> None:
    small = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=4)  # 64 tokens
    with pytest.raises(ValueError, match="exceeds the whole KV cache"):
        small.add_request("big", list(range(5, 69)), SamplingParams(max_tokens=1))
    small.add_request("fits", list(range(5, 68)), SamplingParams(max_tokens=1))


def test_unknown_model_dir_and_unsupported_type(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
    foreign = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dir, foreign)
    config = json.loads((foreign / "config.json").read_text())
    config["model_type"] = "gpt2"
    config["architectures"] = ["GPT2LMHeadModel"]
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported"):
        LLMEngine(EngineConfig(model=str(foreign)))


def test_bad_engine_config_names_the_value() -> None:
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        EngineConfig(model="m", block_size=0)
    with pytest.raises(ValueError, match="preemption_mode must be 'recompute' or 'swap'"):
        EngineConfig(model="m", preemption_mode="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer, got 0"):
        EngineConfig(model="m", cpu_threads=0)


@pytest.mark.parametrize("when", ["mid_prefill", "mid_decode", "waiting"])
def test_abort_frees_blocks_at_once(engine: LLMEngine, when: str) -> None:
    engine.add_request("victim", list(range(5, 205)),
                       SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("other", list(range(5, 40)), SamplingParams(max_tokens=5,
                                                                   ignore_eos=True))
    if when == "mid_prefill":
        _steps_until(engine, "victim", 16)
        assert engine.scheduler.requests["victim"].num_computed_tokens < 200
    elif when == "mid_decode":
        _steps_until(engine, "victim", 203)
    used_before = engine.kv.num_used_blocks
    out = engine.abort_request("victim")
    assert out is not None and out.finished and out.finish_reason == "abort"
    other_blocks = len(engine.kv.block_table("other"))
    assert engine.kv.num_used_blocks == other_blocks <= used_before
    assert engine.abort_request("victim") is None
    done = _drain(engine)
    assert list(done) == ["other"]


def test_seeded_sampling_is_reproducible_across_batch_compositions(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234,
                            ignore_eos=True)
    engine.add_request("alone", [5, 6, 7, 8], params)
    alone = _drain(engine)["alone"].token_ids

    for i in range(6):  # noisy neighbours, some sampled without a seed
        engine.add_request(f"n{i}", list(range(10 + i, 60 + 7 * i)),
                           SamplingParams(max_tokens=3 + i, temperature=1.0, ignore_eos=True))
    engine.add_request("crowded", [5, 6, 7, 8], params)
    crowded = _drain(engine)["crowded"].token_ids
    assert crowded == alone

    engine.add_request("other-seed", [5, 6, 7, 8],
                       SamplingParams(max_tokens=12, temperature=0.9, seed=99, ignore_eos=True))
    assert _drain(engine)["other-seed"].token_ids != alone


def test_greedy_ignores_seed_and_top_k(engine: LLMEngine) -> None:
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0,
                                                      ignore_eos=True))
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, seed=3,
                                                      top_k=2, ignore_eos=True))
    done = _drain(engine)
    assert done["a"].token_ids == done["b"].token_ids


def test_top_k_one_is_greedy(engine: LLMEngine) -> None:
    engine.add_request("g", [9, 10], SamplingParams(max_tokens=8, temperature=0,
                                                    ignore_eos=True))
    engine.add_request("k1", [9, 10], SamplingParams(max_tokens=8, temperature=2.0, top_k=1,
                                                     ignore_eos=True))
    done = _drain(engine)
    assert done["g"].token_ids == done["k1"].token_ids


def test_stop_token_ids_and_eos(engine: LLMEngine) -> None:
    engine.add_request("free", [11, 12, 13], SamplingParams(max_tokens=10, temperature=0,
                                                           ignore_eos=True))
    free = _drain(engine)["free"].token_ids
    stop_at = free[3]
    first = free.index(stop_at)
    engine.add_request("stopped", [11, 12, 13], SamplingParams(
        max_tokens=10, temperature=0, stop_token_ids=(stop_at,), ignore_eos=True))
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.delta_text
    assert out.finish_reason == "stop" and out.token_ids == free[:first + 1]
    # As in vLLM: the stop token's id is output, its text only when asked for.
    assert out.text == streamed == engine.tokenizer.decode(free[:first],
                                                           skip_special_tokens=True)
    engine.add_request("kept", [11, 12, 13], SamplingParams(
        max_tokens=10, temperature=0, stop_token_ids=(stop_at,), ignore_eos=True,
        include_stop_str_in_output=True))
    kept = _drain(engine)["kept"]
    assert kept.token_ids == free[:first + 1]
    assert kept.text == engine.tokenizer.decode(free[:first + 1], skip_special_tokens=True)
    assert kept.text != out.text

    eos_engine_ids = sorted(engine.eos_token_ids)
    assert engine.tokenizer.eos_token_id in eos_engine_ids


def test_stop_string_is_cut_and_never_streamed(engine: LLMEngine) -> None:
    engine.add_request("free", "The list", SamplingParams(max_tokens=24, temperature=0,
                                                          ignore_eos=True))
    full = _drain(engine)["free"].text
    assert len(full) > 12
    stop = full[5:9]
    engine.add_request("s", "The list", SamplingParams(max_tokens=24, temperature=0,
                                                       stop=(stop, "never-seen"),
                                                       ignore_eos=True))
    streamed = ""
    final: RequestOutput | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.delta_text
            final = out
    assert final is not None and final.finished and final.finish_reason == "stop"
    assert final.text == full[:full.index(stop)] == streamed
    assert stop not in streamed


def test_streamed_deltas_add_up_to_text(engine: LLMEngine) -> None:
    engine.add_request("d", "Hello world", SamplingParams(max_tokens=20, temperature=0,
                                                          ignore_eos=True))
    pieces, ids = [], []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.delta_text)
            ids.extend(out.delta_token_ids)
            final = out
    assert final is not None
    assert "".join(pieces) == final.text
    assert ids == final.token_ids
    assert final.text == engine.tokenizer.decode(final.token_ids, skip_special_tokens=True)


def test_metrics_count_tokens_and_time(engine: LLMEngine) -> None:
    before = engine.stats()
    engine.add_request("m1", list(range(300, 400)), SamplingParams(max_tokens=7,
                                                                 ignore_eos=True))
    out = _drain(engine)["m1"]
    after = engine.stats()
    assert after.prompt_tokens - before.prompt_tokens == 100
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == 100
    assert after.generation_tokens - before.generation_tokens == 7
    assert after.num_requests_finished - before.num_requests_finished == 1
    assert 0 < after.token_budget_utilization <= 1
    assert out.timing is not None and out.timing.ttft is not None and out.timing.ttft > 0
    assert len(out.timing.inter_token_latencies) == 6
    assert after.num_running == after.num_waiting == after.num_swapped == 0
    assert after.kv_blocks_used == 0 and after.kv_blocks_total == 48


def test_llm_generate_keeps_prompt_order(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 2, 5)]
    outs = llm.generate(["one two three", "four", "five six"], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [9, 2, 5]
    single = llm.generate("four", params[1], use_tqdm=False)
    assert single[0].token_ids == outs[1].token_ids
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
