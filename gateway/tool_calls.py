"""Tool calling for chat completions: what the model is told, what it may generate, and how
its text becomes OpenAI ``tool_calls``.

- The tools go to the model's chat template (``tools=``), with assistant ``tool_calls`` and
  ``tool`` results in the history. A template that knows no tools (SmolLM2's does not) gets
  them in a system message instead, with the format to answer in, so the model sees them
  either way.
- ``tool_choice``: ``none`` (plain text), ``auto`` (the model decides; calls are parsed out
  of its text; the first only when ``parallel_tool_calls`` is false), ``required`` (the
  output is constrained to a JSON array of calls, each ``{"name", "arguments"}`` valid
  against its function's parameters; one call when
  ``parallel_tool_calls`` is false) or a named function (the output is constrained to that
  function's arguments). The constraints are structured outputs, so a forced call always
  parses and validates. Under ``auto``, a function with ``strict`` puts the output under a
  structural tag instead: free text, but every call block that opens is held to its
  function.
- Parsing ``auto`` output: ``<tool_call>{...}</tool_call>`` blocks (the Hermes / Qwen
  format most tool-tuned templates use), or a reply that is nothing but a call object (or
  an array of them) naming a known tool. Anything else is content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from engine.invalid_field import InvalidField
from engine.json_schema_combinations import with_required_tags
from engine.json_schema_support import unenforced_keyword
from engine.structured_output import StructuredOutput
from gateway.call_readers import CallArrayReader, CallBlockReader

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"\s*(.*?)\s*" + re.escape(CLOSE_TAG), re.DOTALL)
Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class Function:
    """One tool the caller offers: a function name, what it does, its parameters' schema."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool = False
    """OpenAI's strict: a call's arguments always match the parameters, with auto too."""

    def schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object"}

    def to_template(self) -> dict[str, Any]:
        """As chat templates expect tools (OpenAI's tool object)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.schema()}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools."""

    functions: tuple[Function, ...]
    mode: Mode
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the output may hold calls (and is parsed for them)."""
        return self.mode != "none" and bool(self.functions)

    def constraint(self) -> StructuredOutput | None:
        """The structured output a forced call generates under; with auto, the one that
        holds every call block to its function when a function is strict (None otherwise,
        and for none)."""
        held = self._held_functions()
        for function in held:  # checked before the grammar's wrapping
            if function.strict and (reason := unenforced_keyword(
                    with_required_tags(function.schema()))) is not None:
                at = self.functions.index(function)  # the tools' order: the request's
                raise InvalidField(f"tools.[{at}].function.parameters",
                                   f"the parameters of function {function.name!r}: {reason}; "
                                   "remove it, or check the arguments yourself")
        # A function without strict is held as well as the grammar can (as OpenAI only
        # tries to fit its arguments): a keyword the grammar drops refuses no call of it.
        best_effort = not all(f.strict for f in held)
        if self.mode == "auto" and any(f.strict for f in self.functions):
            return self._strict_blocks()
        if self.mode == "named":
            function = next(f for f in self.functions if f.name == self.named)
            return StructuredOutput("json", json.dumps(function.schema()),
                                    any_whitespace=False, param="tools",
                                    best_effort=best_effort)
        if self.mode != "required":
            return None
        # Each function's parameters keep their own root: under the array's $defs, their
        # local $refs ("#/$defs/X" of a pydantic model, "#" of a recursive one) rebased there.
        roots = {f"tool{i}": rebased(f.schema(), f"#/$defs/tool{i}")
                 for i, f in enumerate(self.functions)}
        call = {"anyOf": [{
            "type": "object",
            "properties": {"name": {"const": f.name},
                           "arguments": {"$ref": f"#/$defs/tool{i}"}},
            "required": ["name", "arguments"], "additionalProperties": False,
        } for i, f in enumerate(self.functions)]}
        array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1,
                                 "$defs": roots}
        if not self.parallel:
            array["maxItems"] = 1
        # Compact: the arguments are re-encoded anyway, and whitespace is where a small
        # model's forced call would wander.
        return StructuredOutput("json", json.dumps(array), any_whitespace=False,
                                param="tools", best_effort=best_effort)

    def _held_functions(self) -> list[Function]:
        """The functions whose arguments the grammar holds to their parameters."""
        if self.mode == "auto":
            return [f for f in self.functions if f.strict]
        if self.mode == "named":
            return [f for f in self.functions if f.name == self.named]
        return list(self.functions) if self.mode == "required" else []

    def _strict_blocks(self) -> StructuredOutput:
        """Free text, but every call block that opens names a known function and is closed
        after arguments matching its parameters (any object for a function not strict), as
        vLLM holds strict functions under auto. A block may put a newline after its open tag
        and before its close tag, as the templates that take tools show it."""
        tags = [{"begin": f'{OPEN_TAG}{gap}{{"name": {json.dumps(f.name)}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema":
                             f.schema() if f.strict else {"type": "object"}},
                 "end": f"}}{gap}{CLOSE_TAG}"}
                for f in self.functions for gap in ("", "\n")]
        # stop_after_first: the text ends with the first call when calls are not parallel.
        return StructuredOutput("structural_tag", json.dumps({
            "type": "structural_tag", "format": {
                "type": "triggered_tags", "triggers": [OPEN_TAG], "tags": tags,
                "at_least_one": False, "stop_after_first": not self.parallel}}), param="tools")

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool_calls) of a finished output; no calls when none parse. A
        forced call's output is the grammar's, never content: the call (a stop string may
        have cut it, as max_tokens may: see parse_cut)."""
        if self.mode in ("named", "required"):
            return self.parse_cut(text)
        if self.mode != "auto":
            return text, []
        if self.reads_calls_as_generated:
            content, found = self.read_calls(text)
            if found:
                return content, found
        # Calls not parallel: the first only, as vLLM keeps it (the others' blocks are
        # dropped from the content with it).
        most = None if self.parallel else 1
        found = [_call(c["name"], c.get("arguments", c.get("parameters")))
                 for c in map(_json, _BLOCK.findall(text)) if self._is_call(c)]
        if found:
            return self._beside_calls(text) or None, found[:most]
        whole = _json(text)
        candidates = whole if isinstance(whole, list) else [whole]
        if candidates and all(self._is_call(c) for c in candidates):
            return None, [_call(c["name"], c.get("arguments", c.get("parameters")))
                          for c in candidates[:most]]
        return text, []

    def named_call(self, arguments: str, name: str | None = None) -> dict[str, Any]:
        """A call of ``name`` (the named tool_choice's by default), with its arguments' text
        (so far, when it opens a streamed call)."""
        return _raw_call(name or self.named or "", arguments)

    def parse_cut(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool_calls) of an output cut at max_tokens. A call a grammar
        holds stays a call, as OpenAI returns it: its arguments are the text so far (not
        JSON yet); under ``required``, every call whose arguments began, else no call and no
        content (the array is the grammar's, never the answer's text). Under ``auto`` as a
        finished output is read: a block closed before the cut is a call (the text ran on
        after it), a held block cut inside a call too; a block the cut left open is
        content."""
        if self.mode == "named":
            return None, [self.named_call(text)]
        if self.mode == "required":
            return None, self.read_calls(text)[1]
        return self.parse(text)

    @property
    def reads_calls_as_generated(self) -> bool:
        """Whether a grammar holds the calls' shape, so that they are read (and streamed)
        as they are generated (gateway/call_readers.py): ``required``'s array, and
        ``auto``'s blocks when a function is strict."""
        return self.mode == "required" or (
            self.mode == "auto" and any(f.strict for f in self.functions))

    def call_reader(self) -> CallArrayReader | CallBlockReader:
        """A reader of the calls as they are generated, for the offered functions."""
        names = frozenset(f.name for f in self.functions)
        if self.mode == "required":
            return CallArrayReader(names)
        return CallBlockReader(names, OPEN_TAG, CLOSE_TAG)

    def read_calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool_calls) as a call reader reads them: each call's arguments
        as generated (the last cut short when the output was); auto's content is the text
        before the first block as it came, then what lies outside blocks after it, less
        trailing whitespace (as a stream sends it); None when there is none."""
        reader = self.call_reader()
        calls = [_raw_call(call.name, call.arguments(text)) for call in reader.feed(text)]
        if isinstance(reader, CallArrayReader):
            return None, calls
        before, after = reader.outside(text)
        return (before + after.rstrip()) or None, calls

    def outside_calls(self, text: str) -> str:
        """The text without its call blocks (auto's content, before stripping)."""
        return _BLOCK.sub("", text) if self.mode == "auto" else ""

    def _beside_calls(self, text: str) -> str:
        """auto's content beside its calls, as a stream sends it: the text before the first
        call as it came (vLLM's content), then what lies outside the calls after it, less
        trailing whitespace."""
        before = max(0, text.find(OPEN_TAG))
        outside = self.outside_calls(text)
        return outside[:before] + outside[before:].rstrip()

    def _is_call(self, value: Any) -> bool:
        names = {f.name for f in self.functions}
        if not isinstance(value, dict) or value.get("name") not in names:
            return False
        arguments = value.get("arguments", value.get("parameters"))
        return isinstance(arguments, dict)

    def streamable_prefix(self, text: str) -> int:
        """How much of a partial output may be sent as content now: nothing that is, or
        could still become, a call."""
        if self.mode in ("required", "named"):
            return 0
        if self.mode != "auto":
            return len(text)
        stripped = text.lstrip()
        if not stripped or stripped[0] in "{[":  # may be a bare JSON call: wait for the end
            return 0
        at = text.find(OPEN_TAG)
        if at >= 0:
            return at
        for keep in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
            if OPEN_TAG.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def system_prompt(self) -> str:
        """The tools as a system message, for chat templates that take no tools."""
        listing = "\n".join(json.dumps(f.to_template()["function"]) for f in self.functions)
        return ("You can call these functions (JSON schemas of their parameters):\n"
                f"{listing}\n"
                f"To call one, answer with {OPEN_TAG}{{\"name\": <function name>, "
                f"\"arguments\": <arguments object>}}{CLOSE_TAG} (one block per call); "
                "otherwise answer in plain text.")


def whole_calls(calls: list[dict[str, Any]]) -> bool:
    """Whether there are calls and every one's arguments are whole JSON (none was cut by
    max_tokens or a stop string): only then did the output end by calling."""
    return bool(calls) and all(is_json(call["function"]["arguments"]) for call in calls)


def is_json(text: str) -> bool:
    """Whether ``text`` is one whole JSON value (a call's arguments not cut short)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return _raw_call(name, json.dumps(arguments))


def _raw_call(name: str, arguments: str) -> dict[str, Any]:
    """A call whose arguments are given as text (cut short, they may not be JSON yet)."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether the template renders the ``tools`` variable (else they go in a system
    message)."""
    return bool(chat_template) and "tools" in str(chat_template)


DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Schema keywords whose values are JSON data, not schemas: a "$ref" there is not a ref."""
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                           "dependentSchemas"})
"""Keywords whose values map names (which may be any word, "enum" too) to schemas."""


def rebased(schema: Any, base: str) -> Any:
    """A copy of ``schema`` with every local $ref ("#...") pointing under ``base`` (a JSON
    pointer, "#/..."), for a schema that becomes a part of a larger one."""
    if isinstance(schema, list):
        return [rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        elif key in NAMED_SCHEMAS and isinstance(value, dict):  # its keys are names
            out[key] = {name: rebased(sub, base) for name, sub in value.items()}
        else:
            out[key] = rebased(value, base)
    return out
