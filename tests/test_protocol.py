"""The engine protocol's types survive their JSON form (what crosses the HTTP boundary), and
errors map to one status per code."""

from __future__ import annotations

import json

import pytest

from engine.generation_defaults import SamplingDefaults
from engine.protocol import (
    ERROR_STATUS,
    EngineError,
    EngineRejected,
    EngineState,
    GenerateRequest,
    PoolSummary,
    StreamChunk,
)
from engine.sampling_params import SamplingParams
from lora.adapter_info import AdapterInfo
from prefix_cache.cache import PrefixUpdate


def _wire(data: dict[str, object]) -> dict[str, object]:
    return dict(json.loads(json.dumps(data)))


def test_generate_request_round_trips() -> None:
    request = GenerateRequest("r1", [5, 6, 7], SamplingParams(
        max_tokens=9, temperature=0.5, top_k=4, seed=2**63, stop=("x", "yz"),
        stop_token_ids=(3,), logprobs=2), adapter="a0", cache_salt="7:tenant",
        priority=-3, deadline=1.7e9, tenant="acme")
    assert GenerateRequest.from_json(_wire(request.to_json())) == request


def test_generate_request_refuses_what_sampling_params_refuse() -> None:
    data = _wire(GenerateRequest("r1", [5]).to_json())
    data["params"] = {"max_tokens": 0}
    with pytest.raises(ValueError, match="max_tokens must be an integer in"):
        GenerateRequest.from_json(data)


def test_stream_chunks_round_trip_with_logprobs_and_errors() -> None:
    chunk = StreamChunk("r1", [11, 12], "ab", 3, 2, None, [{11: -0.5, 4: -2.0}, {12: 0.0}])
    assert StreamChunk.from_json(_wire(chunk.to_json())) == chunk
    failed = StreamChunk.failed("r1", EngineError("request timed out", "timeout"), 3, 1)
    back = StreamChunk.from_json(_wire(failed.to_json()))
    assert (back.finished, back.finish_reason, back.completion_tokens) == (True, "error", 1)
    assert back.error is not None
    assert (back.error.message, back.error.code, back.error.status, back.error.type) == (
        "request timed out", "timeout", 504, "timeout_error")


def test_error_status_comes_from_the_code_unless_given() -> None:
    assert {code: EngineError("m", code).status for code in ERROR_STATUS} == ERROR_STATUS
    refused = EngineRejected.from_json({"message": "unknown adapter 'x'", "code": None}, 404)
    assert (type(refused), refused.status, refused.type, refused.code) == (
        EngineRejected, 404, "invalid_request_error", None)


def test_engine_state_round_trips() -> None:
    state = EngineState(
        instance_id="e0", model="m", draining=False, in_flight=2, num_running=1,
        num_waiting=1, num_swapped=0, kv_blocks_used=7, kv_blocks_total=64, max_loras=2,
        max_lora_rank=16, max_num_seqs=8, block_size=16, publish_every=4, max_model_len=1024,
        max_request_tokens=1000, prefix_hit_rate=0.25,
        kv_pools={"base": PoolSummary(5, 3, 1, 0.5)},
        adapters=[AdapterInfo("a0", "/adapters/a0", "ab" * 16, 8, True, 0, False, 1)],
        prefix=PrefixUpdate(cursor=9, full=True, added=[2**127 + 5, 3], removed=[]),
        sampling_defaults=SamplingDefaults(temperature=0.2, top_p=0.9, top_k=20))
    assert EngineState.from_json(_wire(state.to_json())) == state
