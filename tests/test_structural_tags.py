"""vLLM's two forms of structural tag, as xgrammar compiles them (gateway/structural_tags.py):
the grammar accepts text whose sections match their schemas and refuses the others."""

from __future__ import annotations

from typing import Any

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from gateway.structural_tags import structural_tag_text

COUNT = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _accepts(tag: dict[str, Any], text: str) -> bool:
    grammar = xgrammar.Grammar.from_structural_tag(structural_tag_text(tag))
    return bool(_is_grammar_accept_string(grammar, text))


def test_the_format_form_is_xgrammars_own() -> None:
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<r>", "content": {"type": "json_schema", "json_schema": COUNT},
        "end": "</r>"}}
    assert _accepts(tag, '<r>{"n": 1}</r>')
    assert not _accepts(tag, '<r>{"n": "one"}</r>')
    assert not _accepts(tag, 'free <r>{"n": 1}</r>')  # a tag alone: no free text


def test_the_structures_form_is_free_text_with_held_sections() -> None:
    tag = {"structures": [{"begin": "<f=add>", "schema": COUNT, "end": "</f>"},
                          {"begin": "<f=any>", "end": "</f>"}],  # no schema: any JSON
           "triggers": ["<f="]}
    assert _accepts(tag, 'Sure. <f=add>{"n": 2}</f> and <f=any>[1, "x"]</f> done.')
    assert _accepts(tag, "no section at all")
    assert not _accepts(tag, 'Sure. <f=add>{"n": "two"}</f>')
    assert not _accepts(tag, 'Sure. <f=sub>{"n": 2}</f>')  # a trigger starts a structure


@pytest.mark.parametrize("tag, message", [
    ({}, "a structural tag is"),
    ({"type": "bogus", "format": {}}, "type is"),
    ({"format": [1]}, "format must be an object"),
    ({"format": {}, "triggers": []}, "takes no 'triggers'"),
    ({"structures": [{"begin": "<a>"}], "triggers": ["<a"]}, "each of a structural tag's"),
    ({"structures": [], "triggers": [""]}, "triggers are non-empty texts"),
])
def test_what_is_neither_form_is_named(tag: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        structural_tag_text(tag)
