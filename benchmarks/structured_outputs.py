"""Structured outputs under load: does every JSON-schema-constrained output validate, and
what does the token masking cost per engine step?

    python -m benchmarks.structured_outputs [--requests 1000] [--out FILE] [--model DIR]
        [--max-tokens 160] [--max-num-seqs 64] [--mask-requests 128] [--mask-repeats 2]
        [--threads 2]

Eight realistic JSON schemas (a person, a postal address, a catalogue product, a calendar
event, a yes/no review classification, a nested order, a support ticket, a recipe; every
string bounded by maxLength or a pattern and every array by maxItems, so a valid output
ends), each with chat prompts that ask for that JSON (the schema is in the prompt, rendered
with the tokenizer's chat template). The model defaults to SmolLM2-135M-Instruct in float32
(fetched and converted once, as engine.default_model does it).

1. Validity: ``--requests`` requests, round-robin over the schemas, temperature 0.8 with a
   seed per request, all added at once to one engine (max_num_seqs 64) and stepped until
   done, as LLM.generate does (by hand here, to time each step). Every output that ended
   with finish_reason "stop" must parse with json.loads and validate against its schema
   (the ``jsonschema`` package when importable, else ``jsonschema_rs``, and beside either
   this module's validator of the keywords the schemas use). Target: 0 invalid; outputs
   cut at max_tokens ("length") are counted apart, with how many of them already hold a
   complete valid object (only the end-of-sequence token was missing). The engine's
   warnings that a sampled token was outside its grammar (a failed mask) are counted too.
2. Masking cost: the first ``--mask-requests`` of those requests run again, constrained (A)
   and plain (B: the same prompts and seeds without the constraint), alternating A B A B.
   Left to end on their own, plain outputs run longer than constrained ones, and longer
   contexts make a slower forward pass that is no cost of the masking; so each plain
   request generates exactly as many tokens as its constrained run did (max_tokens = that
   length with ignore_eos, which only a request without a constraint may set). Both arms
   then decode the same tokens in the same batches and their steps pair up one to one.
   The figures are engine.metrics' phase timings of the decode-only steps (no prefill
   chunk): the sample phase (logit adjustments, the grammar's bitmask fill and apply,
   sampling, the matchers' advance), the step outside the forward pass, and the whole
   step, as medians per step and per decoded token, and what the constraint adds to a
   paired step. The forward pass is the same work in both arms: its ratio, 1 on a quiet
   host, shows how far another process's load moved the comparison.
3. Compile time: each schema compiled by a fresh GrammarCompiler of the engine's tokenizer
   (first compile, then the cached lookup a repeated schema gets), and the compiler's own
   set-up (reading the vocabulary, once per engine).

Prints a table and writes a JSON summary (default benchmarks/results/structured_outputs.json)
with the invalid outputs in full (schema, seed, text, errors) so that each can be replayed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.default_model import ensure_default_model, loragate_home
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.metrics import StepTiming
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarCompiler, StructuredOutput

DEFAULT_OUT = Path(__file__).parent / "results" / "structured_outputs.json"
SYSTEM_PROMPT = ("You are a careful assistant that answers with a single JSON object and "
                 "nothing else.")
LENGTH_EXAMPLES = 20
"""Length-cut outputs kept in the JSON summary (all invalid "stop" outputs are kept)."""


@dataclass(frozen=True)
class SchemaCase:
    """One JSON schema and the user requests that ask for an object of it."""

    name: str
    schema: dict[str, Any]
    requests: tuple[str, ...]

    @property
    def structured(self) -> StructuredOutput:
        return StructuredOutput("json", json.dumps(self.schema))


def _obj(properties: dict[str, Any], optional: Sequence[str] = ()) -> dict[str, Any]:
    """A closed object schema: every property required unless named in ``optional``, no
    other property allowed (what OpenAI's strict mode asks of a schema)."""
    return {"type": "object", "properties": properties,
            "required": [p for p in properties if p not in optional],
            "additionalProperties": False}


def _str(max_length: int, min_length: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _pattern(regex: str) -> dict[str, Any]:
    return {"type": "string", "pattern": regex}


def _int(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _num(low: float, high: float) -> dict[str, Any]:
    return {"type": "number", "minimum": low, "maximum": high}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _list(items: dict[str, Any], max_items: int, min_items: int = 1) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


EMAIL = r"^[a-z0-9._]{1,24}@[a-z0-9-]{1,16}\.[a-z]{2,4}$"
BOOLEAN = {"type": "boolean"}


def schema_cases() -> tuple[SchemaCase, ...]:
    """The eight schemas of the benchmark and their prompts."""
    return (
        SchemaCase("person", _obj({
            "name": _str(40), "age": _int(0, 120), "occupation": _str(40),
            "languages": _list(_str(20), 4), "email": _pattern(EMAIL)}, optional=("email",)),
            ("Extract the person described here: 'Maria Lopez, 34, works as a nurse in "
             "Seville. She speaks Spanish, English and a little French. Write to her at "
             "maria.lopez@example.com.'",
             "Extract the person described here: 'Kenji Sato is a 52-year-old architect "
             "from Osaka who speaks Japanese and German.'")),
        SchemaCase("address", _obj({
            "street": _str(60), "city": _str(40), "postal_code": _pattern(r"^[0-9]{5}$"),
            "country": _enum("France", "Germany", "Italy", "Spain", "United Kingdom",
                             "United States")}),
            ("What is the postal address of the Louvre museum in Paris?",
             "Write this address as a record: 'Brandenburger Tor, Pariser Platz, 10117 "
             "Berlin, Germany'.")),
        SchemaCase("product", _obj({
            "name": _str(50), "price": _num(0, 10000), "currency": _enum("USD", "EUR", "GBP"),
            "tags": _list(_str(20), 5), "in_stock": BOOLEAN}),
            ("Write a catalogue entry for this product: a stainless steel water bottle, "
             "750 ml, keeps drinks cold for 24 hours, 24.90 euros, available now.",
             "Write a catalogue entry for this product: wireless noise-cancelling "
             "headphones, 30 hours of battery, $199, currently sold out.")),
        SchemaCase("event", _obj({
            "title": _str(60),
            "date": _pattern(r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"),
            "start_time": _pattern(r"^([01][0-9]|2[0-3]):[0-5][0-9]$"),
            "location": _str(60), "expected_attendees": _int(1, 100000)}),
            ("Make a calendar entry for this announcement: 'The Lisbon Python meetup "
             "returns on 14 March 2025 at 18:30 in the Startup Lisboa auditorium; about 80 "
             "people are expected.'",
             "Make a calendar entry: the annual company picnic is on July 5th 2025, starting "
             "at noon in Riverside Park, for roughly 250 employees.")),
        SchemaCase("review", _obj({
            "answer": _enum("yes", "no"), "confidence": _num(0, 1), "reason": _str(100)}),
            ("Is this customer review positive? 'The battery lasts all day and the screen "
             "is gorgeous, but the speakers are a bit quiet.'",
             "Is this customer review positive? 'Arrived broken, and support never answered "
             "my emails. Avoid.'")),
        SchemaCase("order", _obj({
            "order_id": _pattern(r"^ORD-[0-9]{6}$"),
            "customer": _obj({"name": _str(40), "email": _pattern(EMAIL)}),
            "items": _list(_obj({"sku": _pattern(r"^[A-Z]{3}-[0-9]{3}$"),
                                 "quantity": _int(1, 20), "unit_price": _num(0, 1000)}), 3),
            "total": _num(0, 10000)}),
            ("Turn this message into an order record: 'Hi, this is John Smith "
             "(john.smith@mail.com). I would like 2 notebooks (NTB-001, 3.50 each) and one "
             "pen set (PEN-204, 12.00). My order number is ORD-104233.'",
             "Turn this message into an order record: 'Order ORD-550912 for Ana Silva, "
             "ana@silva.pt: three coffee mugs, item MUG-310, 8 euros each.'")),
        SchemaCase("ticket", _obj({
            "category": _enum("billing", "technical", "account", "shipping", "other"),
            "priority": _enum("low", "medium", "high", "urgent"), "summary": _str(120),
            "needs_human": BOOLEAN}),
            ("Triage this support email: 'I was charged twice for my subscription this "
             "month and I need a refund as soon as possible.'",
             "Triage this support email: 'The app crashes every time I open the settings "
             "page on my phone since the last update.'")),
        SchemaCase("recipe", _obj({
            "title": _str(60), "servings": _int(1, 12), "prep_minutes": _int(1, 240),
            "ingredients": _list(_str(30), 6), "vegetarian": BOOLEAN}),
            ("Give me a simple recipe for pancakes.",
             "Give me a quick recipe for a tomato and mozzarella salad.")),
    )


# --------------------------------------------------------------------------- prompts
def render_prompt(tokenizer: PreTrainedTokenizerBase, case: SchemaCase, request: str
                  ) -> list[int]:
    """The token ids of one chat turn asking for ``case``'s JSON. A tokenizer without a
    chat template (the tests' tiny model) gets the same text as plain lines."""
    user = (f"{request}\nReply with a JSON object that follows this JSON schema:\n"
            f"{json.dumps(case.schema)}")
    if tokenizer.chat_template:
        text = str(tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}],
            add_generation_prompt=True, tokenize=False))
    else:
        text = f"{SYSTEM_PROMPT}\nUser: {user}\nAssistant: "
    # The template already holds the special tokens: the tokenizer must not add its own.
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


@dataclass(frozen=True)
class Job:
    """One request of the workload: its schema, prompt and (constrained) sampling params."""

    case: SchemaCase
    request: str
    """The user's words (the prompt is them and the schema under the chat template)."""
    prompt: list[int]
    params: SamplingParams

    @property
    def seed(self) -> int | None:
        return self.params.seed

    def plain(self) -> SamplingParams:
        """The same params without the constraint (the masking cost's baseline)."""
        return replace(self.params, structured=None)


def make_jobs(tokenizer: PreTrainedTokenizerBase, cases: Sequence[SchemaCase], n: int, *,
              max_tokens: int, temperature: float, seed: int) -> list[Job]:
    """``n`` requests, round-robin over ``cases`` (and over each case's prompts on every
    pass), request i seeded with ``seed + i``."""
    prompts = {(c.name, r): render_prompt(tokenizer, c, r) for c in cases for r in c.requests}
    jobs = []
    for i in range(n):
        case = cases[i % len(cases)]
        request = case.requests[(i // len(cases)) % len(case.requests)]
        jobs.append(Job(case, request, prompts[case.name, request], SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed + i,
            structured=case.structured)))
    return jobs


# ------------------------------------------------------------------------ validation
Checker = Callable[[Any], list[str]]
"""The errors of one instance against one schema (empty: valid)."""


def validator_backend() -> str:
    """The best validator importable here: "jsonschema", "jsonschema_rs" (schemathesis, a
    dev dependency, brings it) or "builtin" (this module's, for the keywords used here)."""
    for name in ("jsonschema", "jsonschema_rs"):
        if importlib.util.find_spec(name) is not None:
            return name
    return "builtin"


def make_checker(schema: dict[str, Any], backend: str) -> Checker:
    """``backend``'s errors, and the builtin validator's besides: ``jsonschema`` matches a
    pattern with Python's re, whose ``$`` also matches before a final newline, so a string
    "75001\\n" passes "^[0-9]{5}$" there; the builtin one checks patterns as ECMA-262 does
    (as jsonschema_rs does), and a grammar that let such a newline through is what this
    benchmark is for."""
    def builtin(value: Any) -> list[str]:
        return list(builtin_errors(schema, value))

    if backend == "jsonschema":
        import jsonschema

        validator = jsonschema.validators.validator_for(schema)(schema)
        return lambda value: [e.message for e in validator.iter_errors(value)] + [
            f"builtin: {e}" for e in builtin(value)]
    if backend == "jsonschema_rs":
        import jsonschema_rs

        compiled = jsonschema_rs.validator_for(schema)
        return lambda value: [e.message for e in compiled.iter_errors(value)] + [
            f"builtin: {e}" for e in builtin(value)]
    return builtin


_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    # JSON has one number type: 3.0 is an integer to JSON Schema, True is no number.
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def _ecma_anchors(pattern: str) -> str:
    """Python's ``$`` also matches before a final newline, ECMA-262's only at the end: an
    unescaped ``$`` becomes ``\\Z`` (the benchmark's patterns hold none in a class)."""
    return re.sub(r"(?<!\\)\$", r"\\Z", pattern)


def builtin_errors(schema: dict[str, Any], value: Any, path: str = "$") -> Iterator[str]:
    """JSON Schema validation for the keywords of this benchmark's schemas: type, enum,
    const, properties / required / additionalProperties, items / minItems / maxItems,
    minLength / maxLength / pattern, minimum / maximum and their exclusive forms."""
    kind = schema.get("type")
    if kind is not None and not _TYPES[kind](value):
        yield f"{path}: {value!r} is not of type {kind}"
        return
    if "enum" in schema and value not in schema["enum"]:
        yield f"{path}: {value!r} is not one of {schema['enum']}"
    if "const" in schema and value != schema["const"]:
        yield f"{path}: {value!r} is not {schema['const']!r}"
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                yield f"{path}: {key!r} is a required property"
        for key, item in value.items():
            if key in properties:
                yield from builtin_errors(properties[key], item, f"{path}.{key}")
            elif schema.get("additionalProperties", True) is False:
                yield f"{path}: additional property {key!r} is not allowed"
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            yield f"{path}: fewer than {schema['minItems']} items"
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            yield f"{path}: more than {schema['maxItems']} items"
        if "items" in schema:
            for i, item in enumerate(value):
                yield from builtin_errors(schema["items"], item, f"{path}[{i}]")
    if isinstance(value, str):
        # Lengths count code points, as JSON Schema does (Python's len of a str).
        if len(value) < schema.get("minLength", 0):
            yield f"{path}: {value!r} is shorter than {schema['minLength']}"
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            yield f"{path}: {value!r} is longer than {schema['maxLength']}"
        # A schema pattern is not anchored (ECMA-262 search); ASCII classes as ECMA's \d.
        if "pattern" in schema and not re.search(_ecma_anchors(schema["pattern"]), value,
                                                 re.ASCII):
            yield f"{path}: {value!r} does not match {schema['pattern']!r}"
    if _TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            yield f"{path}: {value!r} is less than the minimum {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            yield f"{path}: {value!r} is greater than the maximum {schema['maximum']}"
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            yield f"{path}: {value!r} is not above {schema['exclusiveMinimum']}"
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            yield f"{path}: {value!r} is not below {schema['exclusiveMaximum']}"


def _no_constant(name: str) -> Any:
    # NaN and Infinity parse in Python's json but are not JSON: an output holding them is
    # invalid even where the schema would accept the number.
    raise ValueError(f"{name} is not JSON")


def json_errors(text: str, check: Checker) -> list[str]:
    """Why ``text`` is not one JSON value valid under ``check`` (empty: it is)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        return [f"not JSON: {exc}"]
    return check(value)


@dataclass
class SchemaCounts:
    requests: int = 0
    stop: int = 0
    length: int = 0
    other: int = 0
    """Any other finish reason (abort, error): none is expected."""
    valid: int = 0
    """"stop" outputs that parse and validate."""
    invalid: int = 0
    """"stop" outputs that do not: each one is an engine (or grammar) bug."""
    length_complete: int = 0
    """"length" outputs whose text already is a valid object (only the EOS was missing)."""
    output_tokens: int = 0

    def add(self, other: SchemaCounts) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class Validity:
    """The verdict on one batch of outputs."""

    backend: str
    total: SchemaCounts = field(default_factory=SchemaCounts)
    per_schema: dict[str, SchemaCounts] = field(default_factory=dict)
    invalid: list[dict[str, Any]] = field(default_factory=list)
    length: list[dict[str, Any]] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)
    """One valid output per schema, to read what the model makes of it."""

    def to_json(self) -> dict[str, Any]:
        return {"validator": self.backend, "total": asdict(self.total),
                "per_schema": {k: asdict(v) for k, v in self.per_schema.items()},
                "invalid_outputs": self.invalid, "length_outputs": self.length,
                "examples": self.examples}


def check_outputs(jobs: Sequence[Job], outputs: Sequence[RequestOutput], backend: str
                  ) -> Validity:
    """Count stop / length / other finishes and validate every "stop" output."""
    checkers: dict[str, Checker] = {}
    verdict = Validity(backend)
    for job, out in zip(jobs, outputs, strict=True):
        name = job.case.name
        if name not in checkers:
            checkers[name] = make_checker(job.case.schema, backend)
        counts = verdict.per_schema.setdefault(name, SchemaCounts())
        one = SchemaCounts(requests=1, output_tokens=len(out.token_ids))
        record = {"schema": name, "seed": job.seed, "request": job.request,
                  "finish_reason": out.finish_reason, "request_id": out.request_id,
                  "tokens": len(out.token_ids), "text": out.text}
        errors = json_errors(out.text, checkers[name])
        if out.finish_reason == "stop":
            one.stop = 1
            if errors:
                one.invalid = 1
                verdict.invalid.append({**record, "errors": errors[:5],
                                        "schema_json": job.case.schema,
                                        "token_ids": list(out.token_ids)})
            else:
                one.valid = 1
                verdict.examples.setdefault(name, out.text)
        elif out.finish_reason == "length":
            one.length = 1
            one.length_complete = int(not errors)
            if len(verdict.length) < LENGTH_EXAMPLES:
                verdict.length.append({**record, "complete": not errors})
        else:
            one.other = 1
        counts.add(one)
        verdict.total.add(one)
    return verdict


# ----------------------------------------------------------------------- engine runs
@dataclass(frozen=True)
class StepRecord:
    """One engine step: how many rows sampled a token, prefill tokens computed, timing."""

    rows: int
    prefill_tokens: int
    timing: StepTiming
    cpu_s: float
    """The process's CPU time (all threads) in the step: what the step cost, whatever
    else ran on the host, where the phase timings are wall time."""


@dataclass
class BatchRun:
    outputs: list[RequestOutput]
    steps: list[StepRecord]
    wall_s: float
    preemptions: int

    @property
    def output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def run_batch(engine: LLMEngine, prompts: Sequence[list[int]],
              params: Sequence[SamplingParams], tag: str) -> BatchRun:
    """Add every request at once and step until all are done (LLM.generate's loop), with
    each step's timing and batch rows kept; the outputs come back in prompt order."""
    start = time.perf_counter()
    preempted = engine.stats().num_preemptions
    # make_request compiles a schema the engine has not seen: part of the wall time, as
    # it is in LLM.generate.
    requests = [engine.requests.make_request(f"{tag}-{i}", p, sp)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    order = {r.request_id: i for i, r in enumerate(requests)}
    for request in requests:
        engine.add(request)
    metrics = engine.metrics
    results: list[RequestOutput | None] = [None] * len(requests)
    steps: list[StepRecord] = []
    while engine.has_unfinished_requests():
        before = (metrics.num_steps, metrics.generation_tokens, metrics.prompt_tokens_computed)
        cpu = time.process_time()
        for out in engine.step():
            if out.finished:
                results[order[out.request_id]] = out
        cpu = time.process_time() - cpu
        if metrics.num_steps == before[0] or metrics.last_step is None:
            continue  # an idle step (nothing scheduled) records no timing
        steps.append(StepRecord(rows=metrics.generation_tokens - before[1],
                                prefill_tokens=metrics.prompt_tokens_computed - before[2],
                                timing=metrics.last_step, cpu_s=cpu))
    wall = time.perf_counter() - start
    done = [r for r in results if r is not None]
    assert len(done) == len(results), "a request never finished"
    return BatchRun(done, steps, wall, engine.stats().num_preemptions - preempted)


@dataclass(frozen=True)
class StepSummary:
    """Phase times of a set of steps, per step and per sampled token. Medians: on a shared
    host another process's burst makes a few steps many times slower, which a mean carries
    into the comparison (the means are kept beside them)."""

    steps: int
    tokens: int
    mean_rows: float
    sample_ms_per_step: float
    forward_ms_per_step: float
    outside_forward_ms_per_step: float
    """Schedule, prepare, sample and output: where the constraint's work falls."""
    step_ms_per_step: float
    cpu_ms_per_step: float
    """The process's CPU time per step (StepRecord.cpu_s)."""
    sample_us_per_token: float
    """Median over the steps of the step's sample time / its rows."""
    step_us_per_token: float
    sample_ms_per_step_mean: float
    step_ms_per_step_mean: float

    @classmethod
    def of(cls, steps: Sequence[StepRecord]) -> StepSummary:
        steps = [s for s in steps if s.rows > 0]
        if not steps:
            return cls(0, 0, *(math.nan,) * 10)
        tokens = sum(s.rows for s in steps)
        median = statistics.median
        return cls(
            steps=len(steps), tokens=tokens, mean_rows=tokens / len(steps),
            sample_ms_per_step=1e3 * median(s.timing.sample for s in steps),
            forward_ms_per_step=1e3 * median(s.timing.forward for s in steps),
            outside_forward_ms_per_step=1e3 * median(s.timing.outside_forward for s in steps),
            step_ms_per_step=1e3 * median(s.timing.total for s in steps),
            cpu_ms_per_step=1e3 * median(s.cpu_s for s in steps),
            sample_us_per_token=1e6 * median(s.timing.sample / s.rows for s in steps),
            step_us_per_token=1e6 * median(s.timing.total / s.rows for s in steps),
            sample_ms_per_step_mean=1e3 * statistics.fmean(s.timing.sample for s in steps),
            step_ms_per_step_mean=1e3 * statistics.fmean(s.timing.total for s in steps))


def decode_steps(steps: Sequence[StepRecord]) -> list[StepRecord]:
    """Steps without a prefill chunk: their cost is the decode batch's alone."""
    return [s for s in steps if s.prefill_tokens == 0 and s.rows > 0]


@dataclass
class MaskingResult:
    """The A (constrained) and B (plain, the same lengths) runs' decode-step figures, and
    the steps paired one to one where the two runs' schedules matched."""

    requests: int
    repeats: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[str, list[StepRecord]] = field(
        default_factory=lambda: {"constrained": [], "plain": []})
    pairs: list[tuple[StepRecord, StepRecord]] = field(default_factory=list)

    def summary(self, arm: str) -> StepSummary:
        return StepSummary.of(decode_steps(self.steps[arm]))

    def paired(self) -> dict[str, float]:
        """What the constraint adds to a step, over the paired decode steps (same rows,
        same contexts): per decoded token (the summed time difference over the summed
        rows, and the summed step times' ratio), and at full batch (the pairs with the
        most rows: medians of the differences, with the plain step's time beside them)."""
        if not self.pairs:
            return {"pairs": 0}
        median = statistics.median
        rows = sum(a.rows for a, _ in self.pairs)
        top = max(a.rows for a, _ in self.pairs)
        full = [(a, b) for a, b in self.pairs if a.rows == top]

        def total(phase: str, arm: int) -> float:
            return sum(getattr(pair[arm].timing, phase) for pair in self.pairs)

        return {
            "pairs": len(self.pairs),
            "sample_us_added_per_token": 1e6 * (total("sample", 0) - total("sample", 1)) / rows,
            "step_us_added_per_token": 1e6 * (total("total", 0) - total("total", 1)) / rows,
            "step_time_ratio": total("total", 0) / total("total", 1),
            "forward_time_ratio": total("forward", 0) / total("forward", 1),
            "median_sample_ms_added": 1e3 * median(a.timing.sample - b.timing.sample
                                                   for a, b in self.pairs),
            "median_step_ms_added": 1e3 * median(a.timing.total - b.timing.total
                                                 for a, b in self.pairs),
            "median_step_ratio": median(a.timing.total / b.timing.total
                                        for a, b in self.pairs),
            "median_forward_ratio": median(a.timing.forward / b.timing.forward
                                           for a, b in self.pairs),
            "full_batch_rows": top,
            "full_batch_pairs": len(full),
            "full_batch_sample_ms_added": 1e3 * median(a.timing.sample - b.timing.sample
                                                       for a, b in full),
            "full_batch_step_ms_added": 1e3 * median(a.timing.total - b.timing.total
                                                     for a, b in full),
            "full_batch_plain_step_ms": 1e3 * median(b.timing.total for _, b in full),
            "full_batch_step_ratio": median(a.timing.total / b.timing.total for a, b in full)}

    def ratios(self) -> dict[str, float]:
        """Constrained over plain, of the per-step and per-token medians.
        ``forward_per_step`` is the host check: the same work in both arms, so far from 1
        means the host's load changed between the runs."""
        a, b = self.summary("constrained"), self.summary("plain")
        return {"sample_per_step": a.sample_ms_per_step / b.sample_ms_per_step,
                "step_per_step": a.step_ms_per_step / b.step_ms_per_step,
                "forward_per_step": a.forward_ms_per_step / b.forward_ms_per_step,
                "outside_forward_per_step":
                    a.outside_forward_ms_per_step / b.outside_forward_ms_per_step,
                "cpu_per_step": a.cpu_ms_per_step / b.cpu_ms_per_step,
                "sample_per_token": a.sample_us_per_token / b.sample_us_per_token,
                "step_per_token": a.step_us_per_token / b.step_us_per_token}

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "repeats": self.repeats,
                "ratios": self.ratios(), "paired": self.paired(),
                "decode_steps": {a: asdict(self.summary(a)) for a in self.steps},
                "runs": self.runs}


def measure_masking(engine: LLMEngine, jobs: Sequence[Job], repeats: int,
                    backend: str) -> MaskingResult:
    """Constrained and plain runs of ``jobs``, alternating A B A B so that a drift of the
    host (other load, thermal) falls on both arms alike.

    Each plain request generates exactly as many tokens as its constrained run did
    (max_tokens = that length, ignore_eos): both runs then decode the same tokens in the
    same batches over the same contexts, so their steps differ only by the constraint's
    work and pair up one to one. Left to end on their own, plain outputs run longer, and
    their longer contexts make a slower forward that is no cost of the masking."""
    result = MaskingResult(len(jobs), repeats)
    prompts = [j.prompt for j in jobs]
    for repeat in range(repeats):
        constrained = run_batch(engine, prompts, [j.params for j in jobs],
                                f"mask-constrained-{repeat}")
        plain = run_batch(engine, prompts, [
            replace(j.plain(), max_tokens=len(out.token_ids), ignore_eos=True)
            for j, out in zip(jobs, constrained.outputs, strict=True)], f"mask-plain-{repeat}")
        a, b = decode_steps(constrained.steps), decode_steps(plain.steps)
        # The scheduler is deterministic: the same requests of the same lengths give the
        # same steps. Should they differ, the runs are still compared as two sets.
        matched = [(x.rows, x.prefill_tokens) for x in constrained.steps] == \
            [(y.rows, y.prefill_tokens) for y in plain.steps]
        if matched:
            result.pairs.extend(zip(a, b, strict=True))
        for arm, run in (("constrained", constrained), ("plain", plain)):
            result.steps[arm].extend(run.steps)
            entry: dict[str, Any] = {
                "arm": arm, "repeat": repeat, "wall_s": run.wall_s,
                "output_tokens": run.output_tokens, "steps": len(run.steps),
                "schedules_matched": matched, "preemptions": run.preemptions,
                "decode": asdict(StepSummary.of(decode_steps(run.steps)))}
            if arm == "constrained":  # more outputs to validate, for free
                entry["validity"] = asdict(check_outputs(jobs, run.outputs, backend).total)
            result.runs.append(entry)
    return result


@dataclass(frozen=True)
class CompileTimes:
    """Seconds of a fresh compiler's set-up, and each schema's first and cached compile."""

    setup_s: float
    first_s: dict[str, float]
    cached_s: dict[str, float]


def measure_compile(engine: LLMEngine, cases: Sequence[SchemaCase]) -> CompileTimes:
    """Compile every schema with a compiler of its own, as the engine's is built (the
    engine's one has compiled them already once it has run, so it could not show the
    first compile)."""
    start = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, engine.model_shape.vocab_size,
                               engine.eos_token_ids)
    setup = time.perf_counter() - start
    first: dict[str, float] = {}
    cached: dict[str, float] = {}
    for case in cases:
        for times in (first, cached):
            start = time.perf_counter()
            compiler.compile(case.structured)
            times[case.name] = time.perf_counter() - start
    return CompileTimes(setup, first, cached)


class RejectionCounter(logging.Handler):
    """Counts the runner's "token is outside its grammar" warnings: a sampled token the
    mask should have made impossible."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "outside its grammar" in record.getMessage():
            self.count += 1
            if len(self.first) < 10:
                self.first.append(record.getMessage())


def warm_up(engine: LLMEngine, jobs: Sequence[Job]) -> None:
    """A short constrained and plain batch first: the CPU kernels are built or loaded and
    the allocator settles before anything is timed. Its prompts are the workload's, so
    the prefix cache starts as warm for the timed runs as it is in steady serving."""
    few = list(jobs[:8])
    prompts = [j.prompt for j in few]
    params = [replace(j.params, max_tokens=8) for j in few]
    run_batch(engine, prompts, params, "warm-constrained")
    run_batch(engine, prompts, [replace(p, structured=None) for p in params], "warm-plain")


# ----------------------------------------------------------------------------- report
def print_report(model: str, args: argparse.Namespace, main: BatchRun, validity: Validity,
                 masking: MaskingResult, compiled: CompileTimes) -> None:
    t = validity.total
    print(f"\nstructured outputs: {Path(model).name}, {t.requests} requests over "
          f"{len(validity.per_schema)} schemas, max_num_seqs {args.max_num_seqs}, max_tokens "
          f"{args.max_tokens}, temperature {args.temperature}, validator {validity.backend}")
    print(f"{'schema':10s} {'requests':>8s} {'stop':>6s} {'length':>6s} {'valid':>6s} "
          f"{'invalid':>7s} {'len+valid':>9s} {'tokens/req':>10s}")
    for name, c in [*validity.per_schema.items(), ("total", t)]:
        print(f"{name:10s} {c.requests:8d} {c.stop:6d} {c.length:6d} {c.valid:6d} "
              f"{c.invalid:7d} {c.length_complete:9d} {c.output_tokens / c.requests:10.1f}")
    if t.other:
        print(f"other finish reasons: {t.other}")
    print(f"wall {main.wall_s:.1f} s, {main.output_tokens} output tokens, "
          f"{main.output_tokens / main.wall_s:.1f} tokens/s, "
          f"{len(main.outputs) / main.wall_s:.2f} requests/s, {len(main.steps)} steps, "
          f"{main.preemptions} preemptions")

    a, b = masking.summary("constrained"), masking.summary("plain")
    ratios, paired = masking.ratios(), masking.paired()
    print(f"\nmasking cost: {masking.requests} requests, {masking.repeats} repeats per arm "
          f"(A B A B), plain outputs as long as the constrained ones; medians over the "
          f"decode steps")
    print(f"{'':24s} {'constrained':>11s} {'plain':>9s} {'ratio':>7s}")
    rows = (("decode steps", a.steps, b.steps, None),
            ("mean rows per step", a.mean_rows, b.mean_rows, None),
            ("sample ms / step", a.sample_ms_per_step, b.sample_ms_per_step,
             ratios["sample_per_step"]),
            ("outside forward ms / step", a.outside_forward_ms_per_step,
             b.outside_forward_ms_per_step, ratios["outside_forward_per_step"]),
            ("forward ms / step", a.forward_ms_per_step, b.forward_ms_per_step,
             ratios["forward_per_step"]),
            ("step ms / step", a.step_ms_per_step, b.step_ms_per_step, ratios["step_per_step"]),
            ("step CPU ms / step", a.cpu_ms_per_step, b.cpu_ms_per_step,
             ratios["cpu_per_step"]),
            ("sample us / token", a.sample_us_per_token, b.sample_us_per_token,
             ratios["sample_per_token"]),
            ("step us / token", a.step_us_per_token, b.step_us_per_token,
             ratios["step_per_token"]))
    for label, x, y, ratio in rows:
        shown = f"{ratio:6.2f}x" if ratio is not None else ""
        print(f"{label:24s} {x:11.2f} {y:9.2f} {shown:>7s}")
    if paired["pairs"]:
        print(f"paired decode steps ({paired['pairs']:.0f}): the constraint adds "
              f"{paired['sample_us_added_per_token']:.0f} us of sample phase per decoded "
              f"token ({paired['step_us_added_per_token']:.0f} us of step); the constrained "
              f"steps take {paired['step_time_ratio']:.3f}x the plain ones' time in all "
              f"(forward {paired['forward_time_ratio']:.3f}x: the host check, 1 when quiet)")
        print(f"at full batch ({paired['full_batch_rows']:.0f} rows, "
              f"{paired['full_batch_pairs']:.0f} pairs): +"
              f"{paired['full_batch_sample_ms_added']:.2f} ms sample phase, +"
              f"{paired['full_batch_step_ms_added']:.2f} ms on a "
              f"{paired['full_batch_plain_step_ms']:.1f} ms plain step "
              f"({paired['full_batch_step_ratio']:.3f}x)")
    else:
        print("(the two arms' schedules differed: no paired steps)")

    firsts = list(compiled.first_s.values())
    print(f"\ngrammar compile: compiler set-up (vocabulary) {1e3 * compiled.setup_s:.0f} ms; "
          f"first compile per schema median {1e3 * statistics.median(firsts):.1f} ms, max "
          f"{1e3 * max(firsts):.1f} ms; cached median "
          f"{1e6 * statistics.median(compiled.cached_s.values()):.1f} us")
    print("  " + ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in compiled.first_s.items()))


def report_json(model: str, args: argparse.Namespace, main: BatchRun, validity: Validity,
                masking: MaskingResult, compiled: CompileTimes) -> dict[str, Any]:
    return {
        "benchmark": "structured_outputs",
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                 "load_average_at_end": list(os.getloadavg())},
        "model": model,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "validity": validity.to_json(),
        "throughput": {"wall_s": main.wall_s, "requests": len(main.outputs),
                       "output_tokens": main.output_tokens,
                       "output_tokens_per_s": main.output_tokens / main.wall_s,
                       "requests_per_s": len(main.outputs) / main.wall_s,
                       "steps": len(main.steps), "preemptions": main.preemptions,
                       "decode_steps": asdict(StepSummary.of(decode_steps(main.steps)))},
        "masking": masking.to_json(),
        "compile": asdict(compiled),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--model", default=None,
                        help="model directory (default: SmolLM2-135M-Instruct, float32, "
                             "under $LORAGATE_HOME, fetched once)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--mask-requests", type=int, default=128)
    parser.add_argument("--mask-repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or str(ensure_default_model(loragate_home(), dtype="float32"))

    llm = LLM(model, device="cpu", max_num_seqs=args.max_num_seqs, seed=args.seed)
    engine = llm.engine
    cases = schema_cases()
    jobs = make_jobs(engine.tokenizer, cases, args.requests, max_tokens=args.max_tokens,
                     temperature=args.temperature, seed=args.seed)
    backend = validator_backend()
    compiled = measure_compile(engine, cases)
    warm_up(engine, jobs)
    print(f"validity: {len(jobs)} requests over {len(cases)} schemas ...", flush=True)

    rejections = RejectionCounter()
    logging.getLogger("engine.structured_output").addHandler(rejections)
    try:
        main_run = run_batch(engine, [j.prompt for j in jobs], [j.params for j in jobs],
                             "main")
        validity = check_outputs(jobs, main_run.outputs, backend)
        print(f"  {main_run.wall_s:.0f} s, {validity.total.invalid} invalid; masking cost: "
              f"{min(len(jobs), args.mask_requests)} requests x {args.mask_repeats} repeats "
              f"per arm ...", flush=True)
        masking = measure_masking(engine, jobs[:args.mask_requests], args.mask_repeats,
                                  backend)
    finally:
        logging.getLogger("engine.structured_output").removeHandler(rejections)

    print_report(model, args, main_run, validity, masking, compiled)
    print(f"tokens sampled outside their grammar (engine warnings): {rejections.count}")
    report = report_json(model, args, main_run, validity, masking, compiled)
    report["grammar_rejections"] = {"count": rejections.count, "first": rejections.first}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    for bad in validity.invalid[:5]:
        print(f"INVALID {bad['schema']} seed {bad['seed']}: {bad['errors'][0]}\n  "
              f"{bad['text']!r}")
    return report


if __name__ == "__main__":
    main()
