"""Keywords structured output holds alone but drops beside others (engine/json_schema_support.py
refuses what these checks find).

xgrammar (0.2.x) compiles each of these schemas and generates as if one keyword were absent:
the siblings of ``$ref``, ``anyOf``, ``oneOf``, ``enum`` and ``const`` (each is taken alone);
``minLength`` / ``maxLength`` beside ``pattern``, and both beside a ``format`` it knows;
type-specific keywords in a schema without ``type``; ``multipleOf`` with a bound on one side
only; a lookahead, or an anchor inside, a ``pattern``; ``unevaluatedProperties`` /
``unevaluatedItems`` beside what they would close; and ``oneOf``, held as ``anyOf``, so an
instance may match two branches. Each check returns (keyword, why), or None.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import regex

ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
    "uniqueItems", "contains", "minContains", "maxContains", "minProperties", "maxProperties",
    "required", "dependentRequired", "dependencies", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "unevaluatedProperties", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "allOf", "anyOf", "oneOf", "not", "if", "then",
    "else", "dependentSchemas", "$ref", "$dynamicRef", "$recursiveRef"})
"""The JSON Schema keywords that constrain an instance, and ``format`` when it names one
of KNOWN_FORMATS. Every other key annotates (title, default, ``discriminator``, OpenAPI's
``nullable``, which xgrammar reads as an annotation too) or is unknown (``x-order``, Gemini's
``propertyOrdering``), and JSON Schema ignores unknown keywords, as the grammar does."""
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
STRING_KEYWORDS = ("pattern", "minLength", "maxLength", "format")
ARRAY_KEYWORDS = ("minItems", "maxItems", "uniqueItems")
KNOWN_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uri",
                           "uri-reference", "uri-template", "uuid", "ipv4", "ipv6", "hostname",
                           "json-pointer", "relative-json-pointer"})
"""The formats the grammar generates (others are annotations, as JSON Schema allows)."""
SCALAR_CHECKS = frozenset({"type", *NUMBER_KEYWORDS, "pattern", "minLength", "maxLength"})
"""Siblings of enum / const that are checked against each allowed value here."""
_TYPE_OF = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}

URL_LENGTH = 2083
"""The longest URL browsers took (pydantic's maxLength for its URL types): a maxLength this
large beside a format is let through, though the grammar drops it. A model writing a longer
value would have to write one address of over 2,000 characters."""

Found = tuple[str, str] | None


def combination_problem(node: dict[str, Any], root: Any) -> Found:
    """The first keyword of ``node`` the grammar would drop beside the others (``root``, the
    whole schema, resolves local $refs of oneOf branches)."""
    for check in (_taken_alone, _string_keywords, _untyped, _multiple_of, _pattern,
                  _unevaluated):
        found = check(node)
        if found is not None:
            return found
    return _one_of(node, root)


def _constraints(node: dict[str, Any], besides: tuple[str, ...]) -> list[str]:
    return [key for key in node if key not in besides and (
        key in ASSERTIONS or (key == "format" and _known_format(node)))]


def _known_format(node: dict[str, Any]) -> bool:
    """Whether the node's ``format`` is one the grammar generates (any other value, a
    non-string included, annotates)."""
    value = node.get("format")
    return isinstance(value, str) and value in KNOWN_FORMATS


def _taken_alone(node: dict[str, Any]) -> Found:
    for keyword in ("$ref", "anyOf", "oneOf"):
        if keyword in node:
            others = _constraints(node, (keyword,))
            if others:
                into = "the referenced schema" if keyword == "$ref" else "each branch"
                return others[0], (f"structured output drops it beside {keyword}: move it "
                                   f"into {into}")
    for keyword in ("enum", "const"):
        if keyword not in node:
            continue
        values = [node["const"]] if keyword == "const" else node[keyword]
        others = _constraints(node, ("enum", "const"))
        for other in others:
            if other not in SCALAR_CHECKS:
                return other, f"structured output drops it beside {keyword}"
        for value in values if isinstance(values, list) else []:
            broken = _scalar_breaks(node, value)
            if broken is not None:
                return broken, (f"{keyword} allows {_short(value)}, which it forbids: "
                                f"structured output would generate it (remove that value)")
    return None


def _scalar_breaks(node: dict[str, Any], value: Any) -> str | None:
    """The sibling keyword (of SCALAR_CHECKS) that ``value`` breaks, if any."""
    kinds = node.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        kind = _TYPE_OF.get(type(value))
        fits = kind in kinds or (kind == "integer" and "number" in kinds) or (
            kind == "number" and "integer" in kinds and float(value).is_integer())
        if not fits:
            return "type"
    if isinstance(value, int | float) and not isinstance(value, bool):
        bounds = {"minimum": lambda b: value >= b, "maximum": lambda b: value <= b,
                  "exclusiveMinimum": lambda b: value > b,
                  "exclusiveMaximum": lambda b: value < b,
                  "multipleOf": lambda b: b > 0 and math.isclose(value / b, round(value / b))}
        for keyword, holds in bounds.items():
            bound = node.get(keyword)
            if isinstance(bound, int | float) and not isinstance(bound, bool) and \
                    not holds(bound):
                return keyword
    if isinstance(value, str):
        if isinstance(node.get("minLength"), int) and len(value) < node["minLength"]:
            return "minLength"
        if isinstance(node.get("maxLength"), int) and len(value) > node["maxLength"]:
            return "maxLength"
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            try:
                if regex.search(pattern, value, timeout=0.1) is None:
                    return "pattern"
            except (regex.error, TimeoutError):
                return "pattern"
    return None


def _string_keywords(node: dict[str, Any]) -> Found:
    lengths = [key for key in ("minLength", "maxLength") if key in node]
    if _known_format(node):
        for key in ("pattern", *lengths):
            if key in node and not _implied_beside_format(key, node[key]):
                return key, (f"structured output drops it beside format "
                             f"{str(node['format'])!r}")
        lengths = []
    if "pattern" in node and lengths:
        return lengths[0], ("structured output drops it beside pattern: bound the length "
                            "in the pattern instead")
    return None


def _implied_beside_format(key: str, bound: Any) -> bool:
    """A length bound that a format's values meet as the grammar writes them: at least one
    character (no value of a format is empty), or at most URL_LENGTH (pydantic's URL types
    say minLength 1 and maxLength 2083 beside format "uri")."""
    if isinstance(bound, bool) or not isinstance(bound, int):
        return False
    return bound <= 1 if key == "minLength" else key == "maxLength" and bound >= URL_LENGTH


def _untyped(node: dict[str, Any]) -> Found:
    if "type" in node or any(k in node for k in ("enum", "const", "anyOf", "oneOf", "$ref")):
        return None
    for keyword in (*NUMBER_KEYWORDS, *STRING_KEYWORDS, *ARRAY_KEYWORDS):
        if keyword in node:
            if keyword == "format" and not _known_format(node):
                continue  # an annotation
            return keyword, "structured output holds it only in a schema that gives type"
    return None


def _multiple_of(node: dict[str, Any]) -> Found:
    if "multipleOf" not in node:
        return None
    low = "minimum" in node or "exclusiveMinimum" in node
    high = "maximum" in node or "exclusiveMaximum" in node
    if low != high:
        return "multipleOf", ("structured output drops it with a bound on one side only: "
                              "give both a lower and an upper bound, or neither")
    return None


def _pattern(node: dict[str, Any]) -> Found:
    pattern = node.get("pattern")
    if not isinstance(pattern, str):
        return None
    why = pattern_problem(pattern)
    return ("pattern", f"structured output drops {why}") if why is not None else None


def pattern_problem(pattern: str) -> str | None:
    """What of ``pattern`` the grammar would ignore: a lookahead, or a ``^`` / ``$`` anchor
    that does not begin or end the pattern or one of its alternatives; None when nothing."""
    in_class = False
    at = 0
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            at += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            if pattern[at + 1:at + 2] == "]" or pattern[at + 1:at + 3] == "^]":
                at += 2 if pattern[at + 1] == "]" else 3  # a literal "]" first in the class
                continue
        elif pattern.startswith(("(?=", "(?!"), at):
            return "a lookahead in the pattern"
        elif char == "^" and at > 0 and not pattern[:at].endswith(("(", "|", "(?:")):
            return "a '^' inside the pattern"
        elif char == "$" and at + 1 < len(pattern) and pattern[at + 1] not in ")|":
            return "a '$' inside the pattern"
        at += 1
    return None


def _unevaluated(node: dict[str, Any]) -> Found:
    for keyword, closes in (("unevaluatedProperties", "additionalProperties"),
                            ("unevaluatedItems", "items")):
        if keyword in node and node.get(closes, False) is not False:
            return keyword, f"structured output drops it beside {closes}"
    return None


def _one_of(node: dict[str, Any], root: Any) -> Found:
    branches = node.get("oneOf")
    if not isinstance(branches, list):
        return None
    resolved = [_resolve(branch, root) for branch in branches]
    for i, first in enumerate(resolved):
        for j in range(i + 1, len(resolved)):
            if not _exclusive(first, resolved[j]):
                return "oneOf", (f"structured output holds it as anyOf, and an instance may "
                                 f"match branches {i} and {j} both: use anyOf, or make the "
                                 "branches exclusive (other types, or a required const "
                                 "property)")
    return None


def _resolve(schema: Any, root: Any, depth: int = 0) -> Any:
    """A branch with its local $ref followed (a few hops at most)."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 8:
        target: Any = root
        for token in schema["$ref"].removeprefix("#").strip("/").split("/"):
            if not token:
                continue
            token = token.replace("~1", "/").replace("~0", "~")
            target = target.get(token) if isinstance(target, dict) else None
        schema, depth = target, depth + 1
    return schema


def _exclusive(a: Any, b: Any) -> bool:
    """Whether no instance the grammar generates for one branch can match the other (as far
    as these rules can tell: types, constants, numeric ranges, required properties)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not (types_a & types_b):
        return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None:
        return not any(x == y and type(x) is type(y) for x in values_a for y in values_b)
    if _disjoint_ranges(a, b):
        return True
    return _objects_exclusive(a, b)


def _types(schema: dict[str, Any]) -> set[str] | None:
    kinds = schema.get("type")
    if kinds is None:
        values = _values(schema)
        return None if values is None else {_TYPE_OF.get(type(v), "?") for v in values}
    found = set(kinds if isinstance(kinds, list) else [kinds])
    if "number" in found:
        found.add("integer")  # an integer is a number: the two overlap
    return found


def _values(schema: dict[str, Any]) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    return schema["enum"] if isinstance(schema.get("enum"), list) else None


def _disjoint_ranges(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def span(s: dict[str, Any]) -> tuple[float, float]:
        low = s.get("minimum", s.get("exclusiveMinimum", -math.inf))
        high = s.get("maximum", s.get("exclusiveMaximum", math.inf))
        return (low, high) if all(isinstance(x, int | float) for x in (low, high)) else (
            -math.inf, math.inf)

    (low_a, high_a), (low_b, high_b) = span(a), span(b)
    return high_a < low_b or high_b < low_a


def _objects_exclusive(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Objects: a required property whose constants differ, or each branch requiring one
    the other does not list (the grammar generates listed properties only)."""
    props_a, props_b = a.get("properties"), b.get("properties")
    if not isinstance(props_a, dict) or not isinstance(props_b, dict):
        return False
    required_a = set(a.get("required") or ()) if isinstance(a.get("required"), list) else set()
    required_b = set(b.get("required") or ()) if isinstance(b.get("required"), list) else set()
    for name in required_a & required_b:
        values_a = _values(props_a[name]) if isinstance(props_a.get(name), dict) else None
        values_b = _values(props_b[name]) if isinstance(props_b.get(name), dict) else None
        if values_a is not None and values_b is not None and not any(
                x == y for x in values_a for y in values_b):
            return True
    listed_only = all(s.get("additionalProperties", False) is False for s in (a, b))
    return listed_only and bool(required_a - props_b.keys()) and bool(
        required_b - props_a.keys())


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def with_required_tags(schema: Any) -> Any:
    """``schema`` with each discriminated union's tag required in its branches: a oneOf or
    anyOf beside ``discriminator.propertyName`` (pydantic writes one for a tagged union),
    whose branches (local $refs followed) list that property with a const or enum, gets it in
    each such branch's ``required``. A tag with a default is not required by the schema, so a
    generated object could leave it out and match every branch; pydantic cannot read such an
    object as its union at all. A copy; ``schema`` itself when nothing changes."""
    if not _untagged_branches(schema):
        return schema
    copied = copy.deepcopy(schema)
    for branch, tag in _untagged_branches(copied):
        required = branch.get("required")
        branch["required"] = [*(required if isinstance(required, list) else []), tag]
    return copied


def _untagged_branches(schema: Any) -> list[tuple[dict[str, Any], str]]:
    """Each branch of a discriminated union in ``schema`` that lists its tag without
    requiring it, once, with the tag."""
    found: list[tuple[dict[str, Any], str]] = []
    pending: list[Any] = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending += node
            continue
        if not isinstance(node, dict):
            continue
        discriminator = node.get("discriminator")
        tag = discriminator.get("propertyName") if isinstance(discriminator, dict) else None
        for keyword in ("oneOf", "anyOf") if isinstance(tag, str) else ():
            branches = node.get(keyword)
            for branch in branches if isinstance(branches, list) else []:
                target = _resolve(branch, schema)
                properties = target.get("properties") if isinstance(target, dict) else None
                if isinstance(properties, dict) and isinstance(properties.get(tag), dict) \
                        and _values(properties[tag]) is not None \
                        and tag not in (target.get("required") or []) \
                        and all(target is not seen for seen, _ in found):
                    found.append((target, str(tag)))
        pending += [value for key, value in node.items()
                    if key not in ("const", "enum", "default", "examples")]
    return found
