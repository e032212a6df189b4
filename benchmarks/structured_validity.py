"""Validation of the structured-outputs benchmark's outputs: JSON Schema checkers (an
installed validator and a builtin one for the benchmark's keywords) and the per-schema counts
of stop / length finishes, valid and invalid outputs."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.structured_schemas import Job
from engine.request import RequestOutput

LENGTH_EXAMPLES = 20
"""Length-cut outputs kept in the JSON summary (all invalid "stop" outputs are kept)."""


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
