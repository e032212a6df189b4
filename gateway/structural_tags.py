"""vLLM's structural tags, as the engine compiles them (xgrammar's structural tag format).

A structural tag holds parts of an otherwise free text to a format: after a trigger, a
section that opens with a tag's ``begin``, holds content to its schema, and closes with its
``end`` (a tool call the model writes in its own syntax, say). vLLM takes two forms, in
``response_format`` (``"type": "structural_tag"``) and as the JSON text of
``structured_outputs.structural_tag``:

- ``{"format": {...}}``: xgrammar's own format (tags, sequences, triggered tags...), passed
  on as it is;
- ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``: the older one,
  free text in which a trigger starts one of the structures, held to its JSON schema
  (xgrammar's ``triggered_tags``; every ``begin`` starts with a trigger).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def structural_tag_text(tag: Mapping[str, Any]) -> str:
    """The structural tag ``tag`` (either form) as xgrammar's JSON text; ValueError saying
    what is wrong when it is neither form."""
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError("a structural tag's type is \"structural_tag\"")
    if "format" in tag:
        extra = sorted(set(tag) - {"type", "format"})
        if extra:
            raise ValueError(f"a structural tag with a format takes no {extra[0]!r}")
        if not isinstance(tag["format"], dict):
            raise ValueError("a structural tag's format must be an object")
        return json.dumps({"type": "structural_tag", "format": tag["format"]})
    structures, triggers = tag.get("structures"), tag.get("triggers")
    extra = sorted(set(tag) - {"type", "structures", "triggers"})
    if extra or not isinstance(structures, list) or not isinstance(triggers, list):
        raise ValueError("a structural tag is {\"format\": {...}} or {\"structures\": [...], "
                         "\"triggers\": [...]}")
    tags = []
    for structure in structures:
        if not isinstance(structure, dict) or set(structure) - {"begin", "schema", "end"} \
                or not isinstance(structure.get("begin"), str) \
                or not isinstance(structure.get("end"), str):
            raise ValueError("each of a structural tag's structures is {\"begin\": text, "
                             "\"schema\": a JSON schema, \"end\": text}")
        schema = structure.get("schema")
        tags.append({"begin": structure["begin"], "end": structure["end"], "content": {
            "type": "json_schema", "json_schema": {} if schema is None else schema}})
    if not all(isinstance(trigger, str) and trigger for trigger in triggers):
        raise ValueError("a structural tag's triggers are non-empty texts")
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers, "tags": tags,
        "at_least_one": False, "stop_after_first": False}})
