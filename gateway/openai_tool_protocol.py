"""The tools of a chat completions request (OpenAI's shapes): the functions a request
offers, a named tool_choice, and the calls an earlier assistant message made. pydantic: only
at this edge."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from engine.structured_output import MAX_SPEC_CHARS
from gateway.openai_fields import StrictRequest, Unsupported
from gateway.openai_text import Text


def call_arguments(text: str) -> Any:
    """A call's arguments as templates take them: the object, or the text if not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


ToolName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
MAX_TOOLS = 128


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: ToolName
    arguments: Annotated[Text, Field(max_length=MAX_SPEC_CHARS)]
    """A JSON object, as text (OpenAI's encoding)."""


class ToolCall(BaseModel):
    """A call an earlier assistant message made (in the history the client sends back)."""

    model_config = ConfigDict(extra="ignore")
    id: Annotated[Text, Field(max_length=256)] = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: ToolName
    description: Annotated[Text, Field(max_length=MAX_SPEC_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # OpenAI's rule too: a call's arguments are an object (a forced call of a string
        # schema was a call in a stream and content when whole).
        if (found := _not_an_object(value or {})) is not None:
            raise ValueError(f"a function's parameters must be a JSON schema of type "
                             f"object, not {found}")
        return value


def _not_an_object(schema: dict[str, Any]) -> str | None:
    """What makes ``schema`` one of values other than objects (its type, or a keyword of
    other values where it names no type), None if nothing does."""
    kind = schema.get("type")
    if kind is not None:
        return None if kind in ("object", ["object"]) else json.dumps(kind)[:64]
    for keyword in ("enum", "const", "items", "prefixItems"):
        if keyword in schema:
            return f"a schema of {keyword}"
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        for branch in branches if isinstance(branches, list) else []:
            if isinstance(branch, dict) and (found := _not_an_object(branch)) is not None:
                return found
    return None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictRequest):
    name: ToolName


class NamedToolChoice(StrictRequest):
    """A named function to call; OpenAI's other object form, allowed_tools, is refused by
    name (a request's tools can be narrowed to the allowed ones instead)."""

    type: Literal["function"]
    function: NamedFunction
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = {
        "allowed_tools": Unsupported((), "send only the allowed functions in tools"),
    }
