"""A model's recommended sampling (its generation_config.json) is the default of requests that
leave those fields unset, as in vLLM: read from the file's own keys only, carried to the
gateway in the engine's state, applied by the HTTP edge and by LLM.generate without params,
and off with --generation-config off. The default model gets its model card's values."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import openai
import pytest

from engine.default_model import RECOMMENDED_SAMPLING, recommend_sampling
from engine.generation_defaults import SamplingDefaults, read_sampling_defaults
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from gateway.openai_chat_protocol import ChatCompletionRequest
from tests.live_servers import running, start_serve


def _with_generation_config(tiny_model_dir: Path, out: Path, **keys: object) -> Path:
    model = out / "model"
    shutil.copytree(tiny_model_dir, model)
    path = model / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **keys}))
    return model


def test_only_the_files_own_valid_keys_count(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    assert read_sampling_defaults(tmp_path) == SamplingDefaults()          # no file
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "min_p": 7, "eos_token_id": 2, "do_sample": True}))
    with caplog.at_level(logging.WARNING):
        defaults = read_sampling_defaults(tmp_path)
    assert defaults == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20,
                                        repetition_penalty=1.05)
    assert "min_p=7" in caplog.text                                        # out of range
    assert defaults.to_json() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                  "repetition_penalty": 1.05}
    params = defaults.sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.min_p,
            params.repetition_penalty) == (0.7, 0.8, 20, 0.0, 1.05)
    (tmp_path / "generation_config.json").write_text('{"top_k": -1, "temperature": true}')
    assert read_sampling_defaults(tmp_path) == SamplingDefaults(top_k=0)   # vLLM's "off"
    (tmp_path / "generation_config.json").write_text("not json")
    assert read_sampling_defaults(tmp_path) == SamplingDefaults()


def test_unset_fields_take_the_models_values_and_given_ones_win() -> None:
    defaults = SamplingDefaults(temperature=0.3, top_p=0.5, top_k=20, min_p=0.1,
                                repetition_penalty=1.2)
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    unset = ChatCompletionRequest.model_validate(base).sampling_args(defaults)
    assert {k: unset[k] for k in ("temperature", "top_p", "top_k", "min_p",
                                  "repetition_penalty")} == defaults.to_json()
    given = ChatCompletionRequest.model_validate(
        {**base, "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0,
         "repetition_penalty": 1}).sampling_args(defaults)
    assert {k: given[k] for k in ("temperature", "top_p", "top_k", "min_p",
                                  "repetition_penalty")} == {
        "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0, "repetition_penalty": 1}
    plain = ChatCompletionRequest.model_validate(base).sampling_args(SamplingDefaults())
    assert (plain["temperature"], plain["top_p"], plain["top_k"]) == (1.0, 1.0, 0)


def test_llm_generate_without_params_uses_them(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = _with_generation_config(tiny_model_dir, tmp_path, temperature=0.0, top_k=7)
    llm = LLM(str(model), device="cpu", num_kv_blocks=16, max_loras=0)
    assert llm.get_default_sampling_params().top_k == 7
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0),
                          use_tqdm=False)[0]
    default = llm.generate([[5, 6, 7]], use_tqdm=False)[0]               # 16 tokens, greedy
    assert default.token_ids[:8] == greedy.token_ids
    off = LLM(str(model), device="cpu", num_kv_blocks=16, max_loras=0,
              generation_config="off")
    assert off.get_default_sampling_params() == SamplingParams()


def test_the_server_applies_them_unless_turned_off(tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
    # temperature 0 in the model's file: a request without one is greedy, whatever its seed.
    model = _with_generation_config(tiny_model_dir, tmp_path, temperature=0.0)
    for flags, greedy_by_default in (((), True), (("--generation-config", "off"), False)):
        server = start_serve(tmp_path, "--model", str(model), "--num-kv-blocks", "64",
                             *flags)
        with running(server), openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                                            max_retries=0) as client:
            greedy = client.completions.create(model="model", prompt="The list of",
                                               max_tokens=12, temperature=0).choices[0].text
            unset = {client.completions.create(model="model", prompt="The list of",
                                               max_tokens=12, seed=seed).choices[0].text
                     for seed in (1, 2, 3)}
            # A response object tells the temperature it ran with, as OpenAI's does.
            echoed = client.responses.create(model="model", input="hi", max_output_tokens=1)
        assert echoed.temperature == (0.0 if greedy_by_default else 1.0), flags
        assert (unset == {greedy}) is greedy_by_default, (flags, unset, greedy)


def test_the_default_model_gets_its_model_cards_sampling(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    recommend_sampling(tmp_path)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written == {"eos_token_id": 2, **RECOMMENDED_SAMPLING}
    assert read_sampling_defaults(tmp_path) == SamplingDefaults(temperature=0.2, top_p=0.9)
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')  # chosen: kept
    recommend_sampling(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "temperature": 0.6}
