"""Which JSON Schema keywords structured output cannot hold the text to.

xgrammar (0.2.x) compiles a schema with these keywords without an error and generates as if
they were absent (a few with a warning on stderr, most silently): `[1, 2, 2]` under
``uniqueItems``, ``5`` under ``not: {const: 5}``, ``5.5`` under a number's ``multipleOf: 7``.
A request whose output would then break its own schema is refused instead, naming the
keyword and where it is (vLLM refuses the same schemas when xgrammar is its backend).

Found by compiling a schema per keyword and asking the grammar whether it accepts an
instance that the keyword forbids (tests/test_json_schema_support.py does so for each
entry). Keywords that only annotate (title, description, default, examples, an unknown
``format``) are not constraints, and are let through. A ``required`` name that ``properties``
does not list, and a ``$ref`` outside the schema (never fetched: xgrammar takes it as any
value), are refused the same way, and so are keywords it drops beside others
(engine/json_schema_combinations.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.json_schema_combinations import combination_problem

ALWAYS_UNENFORCED = ("not", "contains", "dependentRequired", "dependentSchemas",
                     "dependencies", "if")
"""Keywords the grammar ignores at any value (minContains and maxContains, then and else
mean nothing without contains and if)."""

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
"""Keywords whose value maps names to subschemas."""
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items",
            "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else")


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of ``schema`` (a parsed JSON schema) that the grammar would not
    enforce, as "`keyword` at JSON-pointer: why"; None when every keyword is held."""
    for path, node in _subschemas(schema, "#"):
        found = _unenforced_here(node) or combination_problem(node, schema)
        if found is not None:
            keyword, why = found
            return f"`{keyword}` at {path}: {why}"
    return None


def _unenforced_here(node: dict[str, Any]) -> tuple[str, str] | None:
    for keyword in ALWAYS_UNENFORCED:
        if keyword in node:
            return keyword, "structured output does not enforce it"
    if node.get("uniqueItems") is True:
        return "uniqueItems", "structured output does not enforce it"
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return "allOf", "structured output enforces it with one schema only"
    if "multipleOf" in node and node.get("type") not in ("integer", ["integer"]):
        return "multipleOf", "structured output enforces it on type integer only"
    required, listed = node.get("required"), node.get("properties")
    missing = [name for name in required if not isinstance(listed, dict) or name not in listed
               ] if isinstance(required, list) else []
    if missing:
        return "required", (f"it names {str(missing[0])[:64]!r}, which properties does not "
                            "list: structured output requires listed properties only")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return "$ref", ("only references within the schema (#...) are followed: a remote "
                        "schema is not fetched")
    return None


def _subschemas(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in ``node`` with its JSON pointer, ``node`` first. Values of
    const, enum, default and examples are data, never walked."""
    if not isinstance(node, dict):
        return  # a boolean schema constrains nothing here
    yield path, node
    for keyword in _SCHEMA_MAPS:
        children = node.get(keyword)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from _subschemas(child, f"{path}/{keyword}/{_escape(str(name))}")
    for keyword in _SCHEMA_LISTS:
        children = node.get(keyword)
        if isinstance(children, list):
            for index, child in enumerate(children):
                yield from _subschemas(child, f"{path}/{keyword}/{index}")
    for keyword in _SCHEMAS:
        child = node.get(keyword)
        if isinstance(child, list):  # items as a list: the draft 4-7 tuple form
            for index, item in enumerate(child):
                yield from _subschemas(item, f"{path}/{keyword}/{index}")
        else:
            yield from _subschemas(child, f"{path}/{keyword}")


def _escape(name: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def structural_tag_schemas(tag: Any) -> Iterator[Any]:
    """The JSON schemas a structural tag (parsed) holds its sections to: the ``json_schema``
    of every content in it that has one (``json_schema``, ``qwen_xml_parameter``...)."""
    if isinstance(tag, dict):
        if isinstance(tag.get("json_schema"), dict | bool):
            yield tag["json_schema"]
            return
        for value in tag.values():
            yield from structural_tag_schemas(value)
    elif isinstance(tag, list):
        for value in tag:
            yield from structural_tag_schemas(value)
