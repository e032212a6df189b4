"""Making requests (engine/request_builder.py) beyond validation: bad words spelled by the
engine's tokenizer, and the adapter identity a request's blocks are hashed under."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.invalid_field import InvalidField
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_bad_words_and_their_token_ids_are_both_banned(tiny_model_dir: Path) -> None:
    builder = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=8).requests
    alone = builder.make_request("a", [5, 6], SamplingParams(bad_words=("no",)))
    spelled = alone.sampling_params.bad_words_token_ids
    assert spelled
    both = builder.make_request("b", [5, 6], SamplingParams(
        bad_words=("no",), bad_words_token_ids=((7, 8),)))
    assert both.sampling_params.bad_words_token_ids == ((7, 8), *spelled)
    # Made again from its own parameters (as a retry would), nothing is banned twice.
    again = builder.make_request("c", [5, 6], both.sampling_params)
    assert again.sampling_params.bad_words_token_ids == both.sampling_params.bad_words_token_ids


def test_a_request_made_before_its_adapter_was_reloaded_hashes_under_the_new_weights(
        tiny_model_dir: Path, tiny_adapters: dict[str, Path]) -> None:
    # Requests are made on the preparing thread; the adapter may be replaced (unloaded and
    # loaded with other weights) before the engine thread admits one.
    engine = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=32)
    engine.load_lora("bot", str(tiny_adapters["a0"]))
    made = engine.requests.make_request("r", [5, 6, 7], SamplingParams(max_tokens=2),
                                        cache_salt="s", lora="bot")
    engine.remove_lora("bot")
    replaced = engine.load_lora("bot", str(tiny_adapters["a1"]))
    assert made.extra_keys[0] != ("lora", *replaced.identity)
    engine.add(made)
    admitted = engine.scheduler.requests["r"]
    assert admitted.extra_keys == (("lora", *replaced.identity), ("salt", "s"))


def test_bad_words_and_their_token_ids_together_stay_within_one_bound(
        tiny_model_dir: Path) -> None:
    builder = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=8).requests
    words = tuple(f"w{i}" for i in range(4096))  # at the limit: two spellings each
    full = builder.make_request("a", [5, 6], SamplingParams(bad_words=words))
    assert len(full.sampling_params.bad_words_token_ids) == 2 * len(words)
    with pytest.raises(InvalidField) as refused:  # one more sequence than both may hold
        builder.make_request("b", [5, 6], SamplingParams(
            bad_words=words, bad_words_token_ids=((7, 7, 7, 7, 7),)))
    assert refused.value.field == "bad_words"
