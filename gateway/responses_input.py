"""The Responses API's ``input``: a string, or a list of items (messages, and the function
calls and their outputs that a client's tool loop sends back), and the chat messages that
carry the same conversation (gateway/openai_chat_protocol.py renders them).

Items a client sends back from an earlier response (``response.output``) keep fields we do
not read (``id``, ``status``, ``annotations``, ``logprobs``): they are ignored, as chat
ignores unknown keys inside messages. Item and content types the model cannot read
(images, files, audio, reasoning, references to stored items) are a 400 naming input, and
where in it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from engine.invalid_field import InvalidField
from engine.structured_output import MAX_SPEC_CHARS
from gateway.openai_chat_protocol import MAX_MESSAGE_PARTS, MAX_MESSAGES
from gateway.openai_protocol import MAX_CONTENT_PARTS
from gateway.openai_text import Text
from gateway.openai_tool_protocol import ToolName

ITEM_TYPES = ("message", "function_call", "function_call_output")
TEXT_PARTS = ("input_text", "output_text")
CallId = Annotated[Text, Field(min_length=1, max_length=256)]


class TextPart(BaseModel):
    """A content part of text: the client's (input_text) or an earlier answer's
    (output_text)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text"]
    text: Text


TextParts = Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]


def _chat_content(content: str | list[TextPart]) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


class MessageItem(BaseModel):
    """A message; ``type`` may be left out, as OpenAI's easy input messages leave it."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | TextParts


class FunctionCallItem(BaseModel):
    """A call the model made in an earlier response."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: CallId
    name: ToolName
    arguments: Annotated[Text, Field(max_length=MAX_SPEC_CHARS)]
    """A JSON object, as text."""


class FunctionCallOutputItem(BaseModel):
    """What the client's function returned for the call ``call_id``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: CallId
    output: Text | TextParts


ITEM_TAGS = {"message": "MessageItem", "function_call": "FunctionCallItem",
             "function_call_output": "FunctionCallOutputItem"}
"""An item's type -> its union member's tag. pydantic puts the tag in an error's location
("input.0.MessageItem.content"); a class name there is read as a tag, not a field, by the
HTTP error handler, so the client is told of input[0].content."""


def _item_type(value: Any) -> Any:
    return value.get("type", "message") if isinstance(value, dict) else \
        getattr(value, "type", None)


def _item_tag(value: Any) -> str | None:
    kind = _item_type(value)
    return ITEM_TAGS.get(kind) if isinstance(kind, str) else None


InputItem = Annotated[Annotated[MessageItem, Tag(ITEM_TAGS["message"])]
                      | Annotated[FunctionCallItem, Tag(ITEM_TAGS["function_call"])]
                      | Annotated[FunctionCallOutputItem,
                                  Tag(ITEM_TAGS["function_call_output"])],
                      Discriminator(_item_tag)]
InputItems = Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]


def check_items(value: Any) -> Any:
    """``input`` as a list of items (a string is one user message), for the field's
    before-validator. Refuses too many items or parts, or an item or part of a type we do not
    serve, before any item is validated: a body's worth of tiny items must cost one error,
    and a wrong type gets a message that names it and where it is."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidField("input", "input is a string or a list of items")
    if len(value) > MAX_MESSAGES:
        raise InvalidField("input", f"input holds {len(value)} items, more than {MAX_MESSAGES}")
    lists = [(i, key, item[key]) for i, item in enumerate(value) if isinstance(item, dict)
             for key in ("content", "output") if isinstance(item.get(key), list)]
    parts = sum(len(found) for _, _, found in lists)
    if parts > MAX_MESSAGE_PARTS:
        raise InvalidField("input", f"input holds {parts} content parts in all, more than "
                                    f"{MAX_MESSAGE_PARTS}")
    for i, item in enumerate(value):
        kind = _item_type(item)
        if isinstance(item, dict) and isinstance(kind, str) and kind not in ITEM_TYPES:
            raise InvalidField("input", f"input[{i}]: items of type {kind[:32]!r} are not "
                                        f"supported: {', '.join(ITEM_TYPES)} only (nothing "
                                        "is stored to refer to)")
    for i, key, found in lists:
        for j, part in enumerate(found):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in TEXT_PARTS:
                raise InvalidField("input", f"input[{i}].{key}[{j}]: content parts of type "
                                            f"{kind[:32]!r} are not supported: the model "
                                            "reads text only (input_text, output_text)")
    return value


def chat_messages(instructions: str | None, items: list[Any]) -> list[dict[str, Any]]:
    """The chat messages of a request: ``instructions`` as a system message first, then the
    input. Calls in a row (a response's parallel calls) are one assistant message's
    ``tool_calls``, joined to the assistant message just before them if there is one (its
    text and calls were one answer); each output is a ``tool`` message, and answers a call
    given before it (as OpenAI requires: nothing is stored that an output could refer to)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    called: set[str] = set()
    for index, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
            called.add(item.call_id)
        else:
            assert isinstance(item, FunctionCallOutputItem)
            if item.call_id not in called:
                raise InvalidField(f"input.[{index}].call_id", (
                    f"no function_call item before input[{index}] has call_id "
                    f"{item.call_id[:64]!r}: send the call with its output"))
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _chat_content(item.output)})
    return messages
