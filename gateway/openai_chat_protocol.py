"""The chat completions request body (POST /v1/chat/completions): messages, tools and the
chat template's options, on top of the sampling fields every endpoint shares
(gateway/openai_protocol.py, whose rules hold here too)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.invalid_field import InvalidField
from engine.structured_output import StructuredOutput
from gateway import openai_fields
from gateway.chat_documents import Documents, documents_chars, documents_system_text
from gateway.openai_fields import Unsupported
from gateway.openai_protocol import (
    MAX_CONTENT_PARTS,
    MAX_LOGPROBS,
    RESERVED_TEMPLATE_KWARGS,
    Int,
    MaxTokens,
    SamplingFields,
)
from gateway.openai_text import Text, valid_text
from gateway.openai_tool_protocol import (
    MAX_TOOLS,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
    call_arguments,
)
from gateway.tool_calls import CLOSE_TAG, OPEN_TAG, Function, ToolPlan


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None \
        = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    """An assistant message's calls."""
    tool_call_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = None
    """A tool message's answer to this call."""

    @model_validator(mode="before")
    @classmethod
    def _refusals_as_text(cls, data: Any) -> Any:
        """An assistant turn's refusal (OpenAI's ``refusal`` field, or a ``refusal`` content
        part: what a client sends back of an earlier answer) is what it said: its text."""
        if not isinstance(data, dict) or data.get("role") != "assistant":
            return data
        content, refusal = data.get("content"), data.get("refusal")
        if isinstance(content, list):
            content = [{"type": "text", "text": part.get("refusal")}
                       if isinstance(part, dict) and part.get("type") == "refusal" else part
                       for part in content]
        if refusal is not None and not content:
            content = refusal
        return {**data, "content": content}

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        # One clear error for an image or audio part, instead of one per union member.
        for part in value if isinstance(value, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content parts of type {kind[:32]!r} are not supported: "
                                 "the model reads text only")
        return value

    @field_validator("content")
    @classmethod
    def _content_text(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        for text in [value] if isinstance(value, str) else [p.text for p in value or []]:
            valid_text(text)
        return value

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # OpenAI's rule: only an assistant message (e.g. one that made tool calls) may come
        # without content; a user turn of null would render as an empty turn.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or text parts)")
        # OpenAI's too: a tool result names the call it answers (templates that render
        # results by call, Mistral's say, need it).
        if self.role == "tool" and self.tool_call_id is None:
            raise InvalidField("tool_call_id", "a tool message needs tool_call_id (the id "
                               "of the call it answers)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # Parts are separate pieces of text: joined by a newline, as vLLM renders them for
        # a template that takes a string (the same prompt, the same answer).
        return "\n".join(part.text for part in self.content)


MAX_TEMPLATE_KWARGS_DEPTH = 32
"""Most nesting of chat_template_kwargs' values: the template's data is copied recursively
(transformers), and a list nested a few hundred deep in a 5 KB body ran out of stack."""


def _nesting_bounded(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` if no list or object in it is nested deeper than MAX_TEMPLATE_KWARGS_DEPTH
    and every number in it is finite, as everywhere else in a request (NaN and Infinity
    are not JSON; walked without recursion: the value itself may be deep)."""
    level: list[Any] = list(value.values())
    for _ in range(MAX_TEMPLATE_KWARGS_DEPTH + 1):  # a scalar ends its nesting
        if any(isinstance(node, float) and not math.isfinite(node) for node in level):
            raise ValueError("values must be finite numbers: NaN and Infinity are not JSON")
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node)]
        if not level:
            return value
    raise ValueError(f"values may nest at most {MAX_TEMPLATE_KWARGS_DEPTH} levels deep")


TemplateKwargs = Annotated[dict[str, Any], Field(max_length=64),
                           AfterValidator(_nesting_bounded)]
"""chat_template_kwargs: extra variables for the model's chat template."""


MAX_MESSAGES = 4096
MAX_MESSAGE_PARTS = 8192
"""Most content parts and tool calls of all messages together. Validating one costs a few
microseconds of the event loop: what fits in a body's 8 MB unbounded took ~1 s."""


def check_message_counts(data: Any) -> None:
    """Refuse a body's too many messages, parts or calls before any is validated (a field's
    own bound is checked only after its items were): for a model's before-validator."""
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        return
    if len(messages) > MAX_MESSAGES:
        raise InvalidField("messages", f"messages holds {len(messages)} messages, more than "
                           f"{MAX_MESSAGES}")
    parts = sum(len(value) for message in messages if isinstance(message, dict)
                for value in (message.get("content"), message.get("tool_calls"))
                if isinstance(value, list))
    if parts > MAX_MESSAGE_PARTS:
        raise InvalidField("messages", f"messages hold {parts} content parts and tool calls "
                           f"in all, more than {MAX_MESSAGE_PARTS}")


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    WHOLE_BODY: ClassVar[bool] = True

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    """End the rendered prompt with the assistant's turn opened (vLLM's default)."""
    continue_final_message: StrictBool = False
    """Render the last (assistant) message open-ended, so the model continues it."""
    echo: StrictBool = False
    """vLLM's: the answer's content starts with the last message's text when that message
    is the answering role's (an assistant message, or any last message without
    add_generation_prompt), e.g. the assistant text that continue_final_message continues."""
    chat_template_kwargs: TemplateKwargs | None = None
    """Extra variables for the model's chat template (e.g. enable_thinking)."""
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    """Empty as none, as vLLM takes it (langchain's bind_tools([]) and litellm send [])."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    documents: Documents | None = None
    """Retrieved documents (gateway/chat_documents.py): rendered by a template that reads
    them, else in a system message. Empty as none."""
    parallel_tool_calls: StrictBool = True
    """False: at most one call per answer (required: the grammar allows one; auto: the first
    call the model wrote is kept)."""
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = openai_fields.CHAT

    @model_validator(mode="before")
    @classmethod
    def _messages_bounded(cls, data: Any) -> Any:
        check_message_counts(data)
        return data

    @model_validator(mode="after")
    def _tools_consistent(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise InvalidField("tools", "tools must have distinct function names")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidField("tool_choice", f"tool_choice names {choice.function.name!r}, "
                               f"which is not among the tools")
        # As OpenAI: a choice among no tools is a mistake; "none" without tools asks for
        # what happens anyway (vLLM takes it).
        if choice not in (None, "none") and not names:
            raise InvalidField("tool_choice", "tool_choice is only allowed when tools are "
                               "given")
        try:
            constraint = self.tool_plan().constraint()
        except InvalidField:  # a function's own parameters: named there
            raise
        except ValueError as exc:  # the tools' schemas, as one grammar, are too large
            raise InvalidField("tools", str(exc)) from None
        if self.echo and self.tool_plan().mode in ("required", "named"):
            raise InvalidField("echo", "echo cannot be combined with a forced tool call "
                               "(tool_choice required or named): its answer is the call")
        if constraint is not None and self.structured_output() is not None and not (
                self._format_of_no_text()):
            raise InvalidField("tool_choice", "a constrained tool call (tool_choice required "
                               "or named, or a strict function) cannot be combined with "
                               "another structured output constraint")
        return self

    def _format_of_no_text(self) -> bool:
        """Whether the only structured output is a response_format beside a forced call: it
        shapes the message's text, and a forced answer is its calls, with no text. OpenAI
        takes the pair (instructor's Responses modes send it); vLLM's guided fields and
        structured_outputs constrain the generated text itself, so they stay refused."""
        given = [name for name, spec in self._constraints() if spec is not None]
        return given == ["response_format"] and self.tool_plan().mode in ("required", "named")

    def structured_constraint(self) -> StructuredOutput | None:
        """The request's constraint: a forced tool call's, else the structured output's."""
        return self.tool_plan().constraint() or self.structured_output()

    @model_validator(mode="after")
    def _template_options(self) -> ChatCompletionRequest:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidField("continue_final_message", "continue_final_message=true needs "
                               "add_generation_prompt=false: the last message is continued, "
                               "not answered")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidField("continue_final_message", "continue_final_message=true needs "
                               "an assistant message last")
        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidField("chat_template_kwargs", f"chat_template_kwargs may not set "
                               f"{', '.join(reserved)}: they are request fields or the "
                               f"server's own")
        return self

    def echoed_text(self) -> str:
        """What ``echo`` puts before the generated content ("" without echo)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return last.text()

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of the tokenizer's apply_chat_template for this request."""
        return {**(self.chat_template_kwargs or {}),
                "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # 0 is vLLM's default: no top list
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_chars(self) -> int:
        """Characters the conversation brings (contents and names), before the template."""
        return sum(len(m.text()) + len(m.name or "") for m in self.messages) \
            + documents_chars(self.documents or [])

    def _compact_json_elsewhere(self) -> bool:
        return self.tool_plan().mode in ("required", "named")  # its calls are single-line JSON

    def tool_plan(self) -> ToolPlan:
        functions = tuple(Function(t.function.name, t.function.description,
                                   t.function.parameters, bool(t.function.strict))
                          for t in self.tools or [])
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return ToolPlan(functions, "named", choice.function.name, self.parallel_tool_calls)
        mode = choice or ("auto" if functions else "none")
        return ToolPlan(functions, mode, None, self.parallel_tool_calls)

    def template_messages(self, tools_in_template: bool = True,
                          documents_in_template: bool = True) -> list[dict[str, Any]]:
        """The conversation as chat templates take it. Calls in the history carry their
        arguments as objects (what templates render); a template that takes no tools gets
        the calls as the text a model answers with, and the tools in a system message; one
        that takes no documents gets them in the system message, before the tools."""
        plan = self.tool_plan()
        messages: list[dict[str, Any]] = []
        for m in self.messages:
            # "developer" is OpenAI's newer name for "system"; chat templates know "system".
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                       "content": m.text()}
            if m.tool_calls and tools_in_template:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {
                        "name": c.function.name,
                        "arguments": call_arguments(c.function.arguments)}}
                    for c in m.tool_calls]
            elif m.tool_calls:
                calls = [json.dumps({"name": c.function.name,
                                     "arguments": call_arguments(c.function.arguments)})
                         for c in m.tool_calls]
                message["content"] += "".join(f"{OPEN_TAG}{c}{CLOSE_TAG}" for c in calls)
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        if self.documents and not documents_in_template:
            _add_system_text(messages, documents_system_text(self.documents))
        if plan.functions and plan.mode != "none" and not tools_in_template:
            _add_system_text(messages, plan.system_prompt())
        return messages

    def template_documents(self) -> list[dict[str, str]] | None:
        """The documents argument of apply_chat_template (None: no documents)."""
        return list(self.documents) if self.documents else None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools argument of apply_chat_template (None: no tools, or tool_choice none)."""
        plan = self.tool_plan()
        return [f.to_template() for f in plan.functions] if plan.active else None


def _add_system_text(messages: list[dict[str, Any]], text: str) -> None:
    """Append ``text`` to the conversation's leading system message, or open it with one."""
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
    else:
        messages.insert(0, {"role": "system", "content": text})
