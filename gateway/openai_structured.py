"""Structured-output request fields of the OpenAI-compatible API: OpenAI's response_format
and vLLM's structured_outputs object (pydantic: only at this edge). Which one constraint a
request asks for is decided by SamplingFields (gateway/openai_protocol.py); each field here
turns into its StructuredOutput, an InvalidField naming the field when it cannot be one."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StrictBool, model_validator

from engine.invalid_field import InvalidField
from engine.structured_output import MAX_SPEC_CHARS, StructuredOutput
from gateway import openai_fields
from gateway.openai_fields import StrictRequest, Unsupported
from gateway.openai_text import Text
from gateway.structural_tags import structural_tag_text

MAX_TAG_STRUCTURES = 1024
"""Most structures (and triggers) of a structural tag."""


def schema_text(schema: dict[str, Any] | str) -> str:
    """A JSON schema as the engine takes it (text); ValueError when it is too long."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"a JSON schema may have at most {MAX_SPEC_CHARS} characters")
    return text


def spec_text(text: str) -> str:
    """A structural tag's text, as the engine takes it; ValueError when it is too long."""
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"a structural tag may have at most {MAX_SPEC_CHARS} characters")
    return text


def field_constraint(field: str, kind: str, spec: str | dict[str, Any] = "",
                     choices: tuple[str, ...] = (),
                     any_whitespace: bool = True) -> StructuredOutput:
    """The constraint ``field`` asks for (``spec``: a JSON schema as an object or text for
    "json"); InvalidField(field) when it cannot be one."""
    try:
        text = schema_text(spec) if kind == "json" else spec
        assert isinstance(text, str)
        return StructuredOutput(kind, text, choices, any_whitespace, param=field)
    except ValueError as exc:
        raise InvalidField(field, str(exc)) from None


class JsonSchemaFormat(StrictRequest):
    """response_format's json_schema object (a key it does not know is a 400, as OpenAI
    answers it: ignored, a client's schema would silently not hold)."""

    name: Annotated[Text, Field(max_length=256)] = "response"
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(StrictRequest):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema
    (``{"type": "json_object", "schema": ...}``, as some providers take a schema, is a 400
    naming ``schema``, not a schema silently dropped); and vLLM's structural tag
    (gateway/structural_tags.py: ``format``, or ``structures`` and ``triggers``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: Annotated[list[Any], Field(max_length=MAX_TAG_STRUCTURES)] | None = None
    triggers: Annotated[list[Any], Field(max_length=MAX_TAG_STRUCTURES)] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise InvalidField("json_schema", "json_schema is given with type json_schema, "
                               "and only then")
        tag_fields = [name for name in ("format", "structures", "triggers")
                      if getattr(self, name) is not None]
        if tag_fields and self.type != "structural_tag":
            raise InvalidField(tag_fields[0], f"{tag_fields[0]} is given with type "
                               "structural_tag only")
        if self.type == "structural_tag":
            self._tag_text()  # refused here, before any engine sees it
        return self

    def _tag_text(self) -> str:
        tag = {name: value for name in ("format", "structures", "triggers")
               if (value := getattr(self, name)) is not None}
        try:
            return spec_text(structural_tag_text(tag))
        except ValueError as exc:
            raise InvalidField("response_format", str(exc)) from None

    def constraint(self, any_whitespace: bool = True) -> StructuredOutput | None:
        """The constraint this format asks for (None: plain text)."""
        if self.type == "json_object":
            return StructuredOutput("json_object", any_whitespace=any_whitespace,
                                    param="response_format")
        if self.json_schema is not None:
            return field_constraint("response_format", "json", self.json_schema.schema_,
                                    any_whitespace=any_whitespace)
        if self.type == "structural_tag":
            return StructuredOutput("structural_tag", self._tag_text(),
                                    param="response_format")
        return None


class StructuredOutputs(StrictRequest):
    """vLLM's structured_outputs object: exactly one constraint."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Annotated[Text, Field(max_length=MAX_SPEC_CHARS)] | None = None
    choice: Annotated[list[Annotated[Text, Field(min_length=1)]],
                      Field(min_length=1, max_length=1024)] | None = None
    grammar: Annotated[Text, Field(max_length=MAX_SPEC_CHARS)] | None = None
    structural_tag: Annotated[Text, Field(max_length=MAX_SPEC_CHARS)] | None = None
    """A structural tag's JSON text, either form (gateway/structural_tags.py)."""
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    """Compact JSON only (no whitespace between tokens), for the request's JSON constraint
    whichever field gives it (response_format, guided_json too, as vLLM merges them)."""
    disable_additional_properties: StrictBool = False
    """Either value: xgrammar (as vLLM runs it) never generates a property the schema does not
    name unless the schema allows others."""
    disable_fallback: StrictBool = False
    """Either value: xgrammar is the only backend, so there is nothing to fall back to."""
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = openai_fields.STRUCTURED_OUTPUTS

    def check_options(self, json_output: bool) -> None:
        """InvalidField when disable_any_whitespace is asked of a request whose output is
        not JSON (``json_output``: a JSON constraint from any field, or a forced call)."""
        if self.disable_any_whitespace and not json_output:
            raise InvalidField("disable_any_whitespace", "structured_outputs."
                               "disable_any_whitespace applies to JSON output: give a JSON "
                               "schema or json_object (in structured_outputs, "
                               "response_format or guided_json)")

    def _tag(self) -> StructuredOutput:
        assert self.structural_tag is not None
        try:
            tag = json.loads(self.structural_tag)
            if not isinstance(tag, dict):
                raise ValueError("a structural tag is a JSON object")
            return StructuredOutput("structural_tag", spec_text(structural_tag_text(tag)),
                                    param="structured_outputs")
        except ValueError as exc:  # JSONDecodeError too
            raise InvalidField("structured_outputs", f"structural_tag: {exc}") from None
        except RecursionError:  # the text parses as it nests: a deep one runs out of stack
            raise InvalidField("structured_outputs", "structural_tag: nested too deep to "
                               "parse") from None

    def constraint(self) -> StructuredOutput | None:
        """The one constraint given (None: none); ValueError when more than one is."""
        whitespace = not self.disable_any_whitespace
        field = "structured_outputs"
        options = [
            None if self.json_ is None else
            field_constraint(field, "json", self.json_, any_whitespace=whitespace),
            None if self.regex is None else field_constraint(field, "regex", self.regex),
            None if self.choice is None else
            field_constraint(field, "choice", choices=tuple(self.choice)),
            None if self.grammar is None else field_constraint(field, "grammar", self.grammar),
            None if self.structural_tag is None else self._tag(),
            StructuredOutput("json_object", any_whitespace=whitespace)
            if self.json_object else None]
        chosen = [option for option in options if option is not None]
        if len(chosen) > 1:
            raise InvalidField("structured_outputs", "structured_outputs takes one of json, "
                               "regex, choice, grammar, structural_tag, json_object")
        return chosen[0] if chosen else None
