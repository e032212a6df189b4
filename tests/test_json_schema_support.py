"""JSON Schema keywords structured output cannot enforce are refused, and the list is held
to the grammar library itself: each refused keyword's schema, compiled by xgrammar, accepts
an instance the keyword forbids (when a release starts enforcing one, its case fails here and
the keyword can be let through)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from engine.invalid_field import InvalidField
from engine.json_schema_combinations import with_required_tags
from engine.json_schema_support import structural_tag_schemas, unenforced_keyword
from engine.structured_output import GrammarCompiler, StructuredOutput

INTEGERS = {"type": "integer"}
# (keyword, schema, an instance the keyword forbids, an instance it allows)
UNENFORCED = [
    ("not", {"type": "integer", "not": {"const": 5}}, "5", "4"),
    ("uniqueItems", {"type": "array", "items": INTEGERS, "uniqueItems": True}, "[1, 1]",
     "[1, 2]"),
    ("contains", {"type": "array", "items": INTEGERS, "contains": {"const": 3}}, "[1]", "[3]"),
    ("dependentRequired", {"type": "object", "properties": {"a": INTEGERS, "b": INTEGERS},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ("dependentSchemas", {"type": "object", "properties": {"a": INTEGERS, "b": INTEGERS},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}',
     '{"a": 1, "b": 2}'),
    ("dependencies", {"type": "object", "properties": {"a": INTEGERS, "b": INTEGERS},
                      "dependencies": {"a": ["b"]}}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ("if", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "9", "6"),
    ("allOf", {"allOf": [INTEGERS, {"minimum": 3}]}, "2", "3"),
    ("multipleOf", {"type": "number", "multipleOf": 7}, "5.5", "14"),
    ("required", {"type": "object", "additionalProperties": INTEGERS, "required": ["k"]},
     "{}", '{"k": 2}'),
    ("$ref", {"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}},
              "required": ["a"]}, '{"a": "any value"}', '{"a": 1}'),
    # Held alone, dropped beside others (engine/json_schema_combinations.py):
    ("minLength", {"type": "string", "pattern": "^a+$", "minLength": 5}, '"a"', '"aaaaa"'),
    ("maxLength", {"type": "string", "enum": ["abcdef", "ab"], "maxLength": 2}, '"abcdef"',
     '"ab"'),
    ("minimum", {"$ref": "#/$defs/i", "minimum": 5, "$defs": {"i": INTEGERS}}, "1", "6"),
    ("type", {"type": "string", "anyOf": [{"type": "object"}, {"type": "string"}]}, "{}",
     '"x"'),
    ("pattern", {"type": "string", "format": "email", "pattern": "^[a-z]+@b[.]co$"},
     '"zz@c.org"', '"a@b.co"'),
    ("minimum", {"minimum": 5}, "1", "6"),  # no type
    ("multipleOf", {"type": "integer", "multipleOf": 7, "minimum": 0}, "45", "14"),
    ("pattern", {"type": "string", "pattern": "^(?!hello)[a-z]+$"}, '"hello"', '"abc"'),
    ("pattern", {"type": "string", "pattern": "c|a^b"}, '"ab"', '"c"'),
    ("oneOf", {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 10},
                         {"type": "integer", "minimum": 5, "maximum": 15}]}, "7", "3"),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": INTEGERS},
                               "additionalProperties": True, "unevaluatedProperties": False},
     '{"a": 1, "b": 2}', '{"a": 1}'),
]
ENFORCED = [  # what stays allowed, and why it may: the grammar refuses the violation
    ({"type": "integer", "multipleOf": 7}, "5"),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, "2"),
    ({"type": "string", "format": "email"}, '"abc"'),
    ({"type": "object", "properties": {"a": INTEGERS}, "additionalProperties": False},
     '{"b": 1}'),
    ({"oneOf": [INTEGERS, {"type": "string"}]}, "true"),
    ({"type": "object", "properties": {"k": INTEGERS}, "required": ["k"]}, "{}"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"],
      "$defs": {"a": INTEGERS}}, '{"a": "x"}'),
    # What pydantic and OpenAI's strict schemas write: taken whole, siblings annotate only.
    ({"$ref": "#/$defs/a", "description": "an a", "$defs": {"a": INTEGERS}}, '"x"'),
    ({"anyOf": [INTEGERS, {"type": "null"}], "default": None, "title": "A"}, '"x"'),
    ({"type": "string", "enum": ["red", "green"], "title": "Colour"}, '"blue"'),
    ({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 70}, "45"),
    ({"type": "string", "format": "not-a-known-format", "pattern": "^[a-z]+$"}, '"B"'),
    ({"type": "string", "pattern": "^[^0-9$]+$"}, '"1"'),
    # Keys JSON Schema does not know are ignored beside anything (vendor extensions).
    ({"anyOf": [INTEGERS, {"type": "null"}], "x-order": 1, "propertyOrdering": ["a"]},
     '"x"'),
    ({"$ref": "#/$defs/a", "x-go-type": "int", "$defs": {"a": INTEGERS}}, '"x"'),
    ({"type": "string", "enum": ["red", "green"], "x-enum-varnames": ["R", "G"]}, '"blue"'),
    # pydantic's HttpUrl: lengths its format's values meet (the 2083 cap let through).
    ({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}, '"no uri"'),
    ({"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
      "discriminator": {"propertyName": "kind"}, "$defs": {
          "cat": {"type": "object", "properties": {"kind": {"const": "cat"}},
                  "required": ["kind"]},
          "dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "age": INTEGERS},
                  "required": ["kind", "age"]}}}, '{"kind": "cat", "age": 1}'),
]


def _accepts(schema: dict[str, Any], instance: str) -> bool:
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
    return bool(_is_grammar_accept_string(grammar, instance))


@pytest.mark.parametrize(("keyword", "schema", "forbidden", "allowed"), UNENFORCED,
                         ids=[case[0] for case in UNENFORCED])
def test_each_refused_keyword_is_one_the_library_ignores(
        keyword: str, schema: dict[str, Any], forbidden: str, allowed: str) -> None:
    assert _accepts(schema, allowed)
    assert _accepts(schema, forbidden), f"xgrammar now enforces {keyword}: let it through"
    reason = unenforced_keyword(schema)
    assert reason is not None and reason.startswith(f"`{keyword}` at #")


@pytest.mark.parametrize(("schema", "forbidden"), ENFORCED)
def test_what_the_library_enforces_is_let_through(schema: dict[str, Any],
                                                  forbidden: str) -> None:
    assert not _accepts(schema, forbidden)
    assert unenforced_keyword(schema) is None


def test_the_keyword_is_found_where_it_is_nested_and_only_where_it_is_one() -> None:
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "string"},  # a property's name, not the keyword
            "choice": {"enum": [{"not": 1}], "default": {"if": 2}},  # data, not schemas
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
        },
        "$defs": {"tag": {"anyOf": [{"type": "string"},
                                    {"type": "array", "prefixItems": [
                                        {"type": "array", "uniqueItems": True}]}]}},
    }
    assert unenforced_keyword(schema) == (
        "`uniqueItems` at #/$defs/tag/anyOf/1/prefixItems/0: structured output does not "
        "enforce it")
    assert unenforced_keyword({"properties": {"a/b~": {"not": {}}}}) == (
        "`not` at #/properties/a~1b~0: structured output does not enforce it")
    assert unenforced_keyword({"type": "array", "uniqueItems": False}) is None
    assert unenforced_keyword(True) is None


def test_a_structural_tags_schemas_are_checked() -> None:
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "tags": [
        {"begin": "<a>", "content": {"type": "json_schema", "json_schema": INTEGERS}},
        {"begin": "<b>", "content": {"type": "json_schema",
                                     "json_schema": {"type": "number", "multipleOf": 2}}}]}}
    assert list(structural_tag_schemas(tag)) == [INTEGERS, {"type": "number", "multipleOf": 2}]


def test_the_engine_refuses_the_spec_naming_its_field(tiny_model_dir: Any) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cache = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                         compile_timeout_s=0)
    try:
        spec = StructuredOutput("json", json.dumps(UNENFORCED[1][1]), param="response_format")
        with pytest.raises(InvalidField, match=r"^the JSON schema's `uniqueItems` at #: ") as \
                caught:
            cache.compile(spec)
        assert caught.value.field == "response_format"
        cache.compile(StructuredOutput("json", json.dumps(ENFORCED[0][0])))
        # Held best-effort (a forced call of a non-strict function), then asked strictly: the
        # best-effort compile in the cache does not answer the strict spec.
        cache.compile(StructuredOutput("json", spec.spec, best_effort=True))
        with pytest.raises(InvalidField, match="uniqueItems"):
            cache.compile(spec)
    finally:
        cache.close()


def test_a_discriminated_unions_tags_are_required_so_its_branches_exclude_each_other() -> None:
    """pydantic's tagged union whose tags have defaults: no branch requires its tag, so an
    object without one would match both (and pydantic could not read it). The tag is made
    required in each branch; the union then holds as oneOf."""
    def branch(kind: str) -> dict[str, Any]:
        return {"type": "object", "properties": {"kind": {"const": kind, "default": kind},
                                                 "n": INTEGERS}, "required": ["n"]}

    union: dict[str, Any] = {"type": "object", "properties": {"pet": {
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
        "discriminator": {"propertyName": "kind"}}}, "required": ["pet"],
        "$defs": {"Cat": branch("cat"), "Dog": branch("dog")}}
    assert unenforced_keyword(union) is not None  # as written, the branches overlap
    tagged = with_required_tags(union)
    assert tagged["$defs"]["Cat"]["required"] == ["n", "kind"]
    assert union["$defs"]["Cat"]["required"] == ["n"]  # a copy: the caller's is kept
    assert unenforced_keyword(tagged) is None
    assert not _accepts(tagged, '{"pet": {"n": 1}}')
    assert _accepts(tagged, '{"pet": {"kind": "dog", "n": 1}}')
    assert with_required_tags(tagged) == tagged
    plain = {"type": "object", "properties": {"a": INTEGERS}}
    assert with_required_tags(plain) is plain
