"""benchmarks/structured_outputs.py at a tiny size on the tiny random model: its outputs are
junk, but every one that ends with "stop" must still validate; the masking measurement and
the compile timing produce their figures; the benchmark's own validator agrees with a real
JSON Schema validator on the benchmark's schemas."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from benchmarks import structured_outputs as bench
from benchmarks.structured_runs import decode_steps, measure_compile, measure_masking, run_batch
from benchmarks.structured_schemas import Job, SchemaCase, make_jobs, schema_cases
from benchmarks.structured_validity import (
    builtin_errors,
    check_outputs,
    json_errors,
    make_checker,
    validator_backend,
)
from engine.llm import LLM

# Tight schemas: a random model given an object spins in the whitespace the JSON grammar
# allows between tokens (a handful of whitespace tokens against one structural token at
# each place) and rarely closes it within a few dozen tokens; enums, booleans, small
# integers, short patterns and arrays of two booleans end fast. One object schema stays,
# to exercise the "length" path.
TINY_CASES = (
    SchemaCase("answer", {"type": "string", "enum": ["yes", "no"]},
               ("Is the sky blue?", "Is water dry?")),
    SchemaCase("flag", {"type": "boolean"}, ("Is this true?",)),
    SchemaCase("level", {"type": "integer", "minimum": 1, "maximum": 5},
               ("Rate this answer from 1 to 5.",)),
    SchemaCase("flags", {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
               ("Two yes/no answers, please.",)),
    SchemaCase("code", {"type": "string", "pattern": "^[A-C][0-9]$"},
               ("Which seat?",)),
    SchemaCase("verdict", {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                       "sure": {"type": "boolean"}},
        "required": ["answer", "sure"], "additionalProperties": False},
        ("Is the sky blue?",)),
)
NAMES = [c.name for c in TINY_CASES]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu", max_num_seqs=8, num_kv_blocks=256)


@pytest.fixture(scope="module")
def jobs(tiny_model_dir: Path) -> list[Job]:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return make_jobs(tokenizer, TINY_CASES, 16, max_tokens=MAX_TOKENS,
                     temperature=0.8, seed=3)


def test_jobs_go_round_robin_with_a_seed_each(jobs: list[Job]) -> None:
    assert [j.case.name for j in jobs] == (NAMES * 3)[:16]
    assert [j.seed for j in jobs] == list(range(3, 19))
    # A case with two prompts alternates them on successive passes.
    assert jobs[0].prompt != jobs[6].prompt and jobs[0].prompt == jobs[12].prompt
    assert all(j.params.structured is not None and j.plain().structured is None for j in jobs)


def test_every_stopped_output_validates(llm: LLM, jobs: list[Job]) -> None:
    run = run_batch(llm.engine, [j.prompt for j in jobs], [j.params for j in jobs],
                    "test-validity")
    for backend in {"builtin", validator_backend()}:
        verdict = check_outputs(jobs, run.outputs, backend)
        total = verdict.total
        assert total.invalid == 0, verdict.invalid
        assert total.requests == 16 and total.stop + total.length + total.other == 16
        assert total.stop > 0 and total.other == 0  # enums and booleans do end
        assert total.valid == total.stop
        assert sum(c.requests for c in verdict.per_schema.values()) == 16
        assert set(verdict.examples) <= set(NAMES)
    assert all(len(o.token_ids) <= MAX_TOKENS for o in run.outputs)
    assert run.steps and all(s.rows <= 8 for s in run.steps)
    assert sum(s.rows for s in run.steps) == run.output_tokens


def test_masking_runs_alternate_and_pair_their_steps(llm: LLM, jobs: list[Job]) -> None:
    result = measure_masking(llm.engine, jobs[:8], repeats=1, backend="builtin")
    constrained, plain = result.runs
    assert (constrained["arm"], plain["arm"]) == ("constrained", "plain")
    assert constrained["validity"]["invalid"] == 0
    # The plain run decodes exactly the constrained run's tokens, in the same steps.
    assert plain["output_tokens"] == constrained["output_tokens"]
    assert plain["steps"] == constrained["steps"] and plain["schedules_matched"]
    paired = result.paired()
    assert paired["pairs"] == len(decode_steps(result.steps["plain"])) > 0
    assert paired["full_batch_pairs"] > 0 and paired["step_time_ratio"] > 0
    for arm in ("constrained", "plain"):
        summary = result.summary(arm)
        assert summary.steps > 0 and summary.sample_ms_per_step > 0
        assert summary.step_ms_per_step >= summary.sample_ms_per_step
    assert all(math.isfinite(v) and v > 0 for v in result.ratios().values())
    json.dumps(result.to_json())  # the summary is plain JSON


def test_every_benchmark_schema_compiles(llm: LLM) -> None:
    cases = schema_cases()
    assert len(cases) == 8 and len({c.name for c in cases}) == 8
    times = measure_compile(llm.engine, cases, timeout_s=1.0)
    assert times.setup_s > 0 and set(times.first_s) == {c.name for c in cases}
    assert all(t > 0 for t in times.cached_s.values())
    assert times.bounded_helper_start_s > 0 and set(times.bounded_first_s) == set(times.first_s)
    assert 1.0 <= times.refused_after_s < 10 and times.next_after_refusal_s > 0


VALID: dict[str, dict[str, Any]] = {
    "person": {"name": "Maria Lopez", "age": 34, "occupation": "nurse",
               "languages": ["Spanish", "English"], "email": "maria.lopez@example.com"},
    "address": {"street": "Rue de Rivoli", "city": "Paris", "postal_code": "75001",
                "country": "France"},
    "product": {"name": "Bottle", "price": 24.9, "currency": "EUR", "tags": ["steel"],
                "in_stock": True},
    "event": {"title": "Meetup", "date": "2025-03-14", "start_time": "18:30",
              "location": "Lisbon", "expected_attendees": 80},
    "review": {"answer": "yes", "confidence": 0.9, "reason": "long battery"},
    "order": {"order_id": "ORD-104233",
              "customer": {"name": "John Smith", "email": "john.smith@mail.com"},
              "items": [{"sku": "NTB-001", "quantity": 2, "unit_price": 3.5}], "total": 19.0},
    "ticket": {"category": "billing", "priority": "high", "summary": "charged twice",
               "needs_human": True},
    "recipe": {"title": "Pancakes", "servings": 4, "prep_minutes": 20,
               "ingredients": ["flour", "milk", "eggs"], "vegetarian": True},
}
# A final newline: Python's "$" matches before it, a JSON Schema pattern's does not.
ODD_VALUES: tuple[Any, ...] = (None, True, 0, 3.0, 2.5, -1, 10**6, "", "x" * 200, "ORD-12",
                               "ORD-104233\n", "2025-13-01", "12:75", "18:30\n", "75001\n",
                               [], ["a"] * 9, {}, {"x": 1})


def _variants(value: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The instance, and copies with one key dropped, one key added, or one value (at the
    top level or one level down) replaced by an odd one."""
    yield value
    yield {**value, "extra": 1}
    for key, item in value.items():
        yield {k: v for k, v in value.items() if k != key}
        for odd in ODD_VALUES:
            yield {**value, key: odd}
        nested = item[0] if isinstance(item, list) and item else item
        if isinstance(nested, dict):
            for inner in nested:
                for odd in ODD_VALUES:
                    changed = copy.deepcopy(value)
                    target = changed[key][0] if isinstance(item, list) else changed[key]
                    target[inner] = odd
                    yield changed


def test_the_builtin_validator_agrees_with_jsonschema_rs() -> None:
    reference = pytest.importorskip("jsonschema_rs")
    checked = 0
    for case in schema_cases():
        strict = reference.validator_for(case.schema)
        assert strict.is_valid(VALID[case.name]), case.name
        for instance in _variants(VALID[case.name]):
            ours = list(builtin_errors(case.schema, instance))
            assert (not ours) == strict.is_valid(instance), (case.name, instance, ours)
            checked += 1
    assert checked > 500


def test_text_that_is_not_json_is_invalid() -> None:
    check = make_checker(TINY_CASES[-1].schema, "builtin")
    assert json_errors('{"answer": "yes", "sure": true}', check) == []
    assert json_errors('{"answer": "yes", "sure": true} x', check)
    assert json_errors('{"answer": "maybe", "sure": true}', check)
    level = make_checker(TINY_CASES[2].schema, "builtin")
    assert json_errors("3", level) == [] and json_errors("3.0", level) == []
    assert json_errors("6", level) and json_errors("NaN", level)  # NaN: not JSON


def test_main_writes_its_summary(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    report = bench.main([
        "--model", str(tiny_model_dir), "--requests", "8", "--max-tokens", "12",
        "--max-num-seqs", "8", "--mask-requests", "8", "--mask-repeats", "1",
        "--threads", str(torch.get_num_threads()), "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["validity"]["total"]["requests"] == 8
    assert written["validity"]["total"]["invalid"] == 0
    assert set(written["compile"]["first_s"]) == {c.name for c in schema_cases()}
    assert written["masking"]["runs"] and report["throughput"]["output_tokens"] > 0
    assert written["grammar_rejections"]["count"] == 0
