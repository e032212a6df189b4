"""Structured outputs in the engine: the grammar holds through preemption (recompute and
swap: a matcher keeps its place while its request waits), across requests with and without
a constraint in one batch, and the spec is checked before the request is admitted."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

from engine.invalid_field import InvalidField
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput, library_reason

PATTERN = r"[a-z]{20,40}\.[0-9]{2,5}"


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_the_grammar_holds_through_preemption(tiny_model_dir: Path,
                                              preemption_mode: str) -> None:
    # 12 blocks of 16 for 12 requests of ~70-token prompts plus their outputs: preemption.
    engine = LLMEngine.from_model(
        str(tiny_model_dir), num_kv_blocks=12, block_size=16, max_num_batched_tokens=64,
        max_num_seqs=12, preemption_mode=preemption_mode, swap_space_bytes=1 << 20)
    rng = random.Random(5)
    constrained = StructuredOutput("regex", PATTERN)
    for i in range(12):
        prompt = [rng.randrange(5, 500) for _ in range(rng.randint(40, 70))]
        engine.add_request(f"r{i}", prompt, SamplingParams(
            max_tokens=60, temperature=1.0, seed=i,
            structured=constrained if i % 3 else None))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.stats().num_preemptions > 0
    for i in range(12):
        out = finished[f"r{i}"]
        if i % 3:
            assert re.fullmatch(PATTERN, out.text), out.text
            assert out.finish_reason == "stop"
    engine.step()  # the runner hears of the last finished requests in the next step
    assert not engine.runner.grammars._matchers  # every matcher released


def test_a_bad_spec_is_refused_before_admission(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=8)
    for spec in (StructuredOutput("regex", "(unclosed"), StructuredOutput("json", "{x"),
                 StructuredOutput("grammar", "root ::= missing"),
                 # The library quotes the spec cut mid-character: its words still come.
                 StructuredOutput("grammar", 'r\u00f6\u00f6t ::= "a"')):
        with pytest.raises(ValueError, match=r"structured output|JSON schema") as caught:
            engine.requests.make_request("r", [5, 6, 7], SamplingParams(structured=spec))
        # The library's reason, without its log prefix (time, source file and line).
        assert ".cc:" not in str(caught.value) and "[" not in str(caught.value)
        assert "codec" not in str(caught.value)
    assert not engine.has_unfinished_requests()


def test_library_reasons_lose_their_log_prefix() -> None:
    assert library_reason("[08:03:11] /project/cpp/regex_converter.cc:94: Regex parsing "
                          "error at position 4\nmore") == "Regex parsing error at position 4"
    assert library_reason("[08:03:11] /p/grammar_compiler.cc:1318: Check failed: (std::"
                          "holds_alternative<Grammar>(result)) is false: Invalid structural "
                          "tag") == "Invalid structural tag"
    assert library_reason("plain words") == "plain words"
    assert library_reason("") == "invalid"


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "xml"}, "kind"), ({"kind": "json"}, "needs its spec"),
    ({"kind": "choice"}, "choice"), ({"kind": "choice", "choices": ("a", "")}, "choice"),
    ({"kind": "regex", "spec": "a" * 70000}, "at most"),
])
def test_structured_output_is_validated(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutput(**kwargs)  # type: ignore[arg-type]


def test_structured_output_with_ignore_eos_is_refused() -> None:
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput("regex", "a+"))
    params = SamplingParams(structured={"kind": "choice",  # type: ignore[arg-type]
                                        "choices": ["a"]})
    assert params.structured == StructuredOutput("choice", choices=("a",))
    assert json.loads(json.dumps(params.structured.to_json()))["choices"] == ["a"]


def test_only_slow_preparation_leaves_the_event_loop(tiny_model_dir: Path) -> None:
    # The async engine prepares a request on its own threads when this says it may take
    # long (so a flood of big grammars cannot stall the loop), and at once otherwise (so a
    # request with a cached grammar does not queue behind them).
    builder = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=8).requests
    spec = StructuredOutput("choice", choices=("yes", "no"))
    assert not builder.takes_long([5, 6], SamplingParams())
    assert builder.takes_long("some text", SamplingParams())
    assert builder.takes_long([5, 6], SamplingParams(bad_words=("no",)))
    assert builder.takes_long([5, 6], SamplingParams(structured=spec))  # not compiled yet
    builder.make_request("r", [5, 6], SamplingParams(structured=spec))
    assert not builder.takes_long([5, 6], SamplingParams(structured=spec))
    other = StructuredOutput("choice", choices=("maybe",))
    assert builder.takes_long([5, 6], SamplingParams(structured=other))

    # Cached per cache salt (a tenant's own): another tenant compiles it again, so that the
    # time of its answer cannot tell it which specs others use.
    builder.make_request("r", [5, 6], SamplingParams(structured=other), cache_salt="a")
    assert not builder.takes_long([5, 6], SamplingParams(structured=other), "a")
    assert builder.takes_long([5, 6], SamplingParams(structured=other), "b")
    assert builder.takes_long([5, 6], SamplingParams(structured=other))


def test_a_spec_that_compiles_too_long_is_refused_and_the_next_one_compiles(
        tiny_model_dir: Path) -> None:
    """A 30-character schema whose compile takes about a minute: refused at the bound (the
    helper process compiling it is killed), naming its field; the next spec is served."""
    builder = LLMEngine.from_model(str(tiny_model_dir), num_kv_blocks=8,
                                   grammar_compile_timeout_s=1.0).requests
    slow = StructuredOutput("json", json.dumps({"type": "string", "pattern": "[a-z]{1,20000}"}),
                            param="response_format")
    quick = StructuredOutput("regex", "[0-9]{3}")
    try:
        builder.make_request("warm", [5, 6], SamplingParams(structured=quick))  # helper up
        started = time.monotonic()
        with pytest.raises(InvalidField, match="longer than 1 s to compile") as caught:
            builder.make_request("r", [5, 6], SamplingParams(structured=slow))
        assert caught.value.field == "response_format"
        assert time.monotonic() - started < 10
        again = StructuredOutput("regex", "[a-c]{2}")
        assert builder.make_request("s", [5, 6], SamplingParams(structured=again)).grammar
        with pytest.raises(InvalidField, match="Regex parsing"):  # a bad spec: its own error
            builder.make_request("t", [5, 6], SamplingParams(structured=StructuredOutput(
                "regex", "(unclosed")))
        # A helper killed from outside is replaced before the next spec; one that dies
        # compiling a spec refuses it (the spec is no safer in the engine's process).
        probe = builder._grammar_compiler()._probe
        assert probe is not None and probe._process is not None
        probe._process.kill()
        probe._process.wait()
        assert builder.make_request("u", [5, 6], SamplingParams(structured=StructuredOutput(
            "regex", "[d-f]{2}"))).grammar
    finally:
        builder.close()


def test_a_matcher_goes_over_budget_on_one_costly_token_or_many_slow_ones() -> None:
    from engine.grammar_matchers import (
        BASE_BUDGET_S,
        PER_TOKEN_BUDGET_S,
        STEP_BUDGET_S,
        _Matcher,
    )

    one = _Matcher(matcher=None)
    one.tokens = 1
    one.charge(STEP_BUDGET_S * 0.9)
    assert one.over is None
    one.charge(STEP_BUDGET_S * 1.5)
    assert one.over is not None and "for one token" in one.over
    # Each token under the step budget, yet together over the base plus a share per token.
    slow = _Matcher(matcher=None)
    step = STEP_BUDGET_S * 0.9
    while slow.over is None:
        slow.tokens += 1
        slow.charge(step)
    assert slow.tokens == int(BASE_BUDGET_S / (step - PER_TOKEN_BUDGET_S)) + 1
    assert slow.over.endswith(f"for {slow.tokens} tokens")
