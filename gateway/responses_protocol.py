"""The Responses API request body (POST /v1/responses, stateless) and the chat completions
request it becomes: the chat path (gateway/openai_api.py) serves it, so its limits, prompt
encoding, admission, routing, tools and structured outputs are the chat endpoint's own.

Fields that chat takes under the same name and meaning (model, temperature, top_p, user,
vLLM's sampling extras, ...) are taken here as they came and validated by
ChatCompletionRequest: one set of bounds for both endpoints. The fields shaped differently
(input, instructions, text, tools, tool_choice, include, max_output_tokens) are validated
here and translated. Whatever the Responses API has that a stateless server without hosted
tools cannot do (previous_response_id, conversation, background, reasoning, prompt, store:
true, built-in tools, image and file inputs) is a 400 naming it, as openai_fields refuses
chat's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.http.errors import describe_errors
from engine.invalid_field import InvalidField
from engine.structured_output import MAX_SPEC_CHARS
from gateway.openai_chat_protocol import ChatCompletionRequest
from gateway.openai_fields import StrictRequest, Unsupported
from gateway.openai_text import Text, valid_text
from gateway.openai_tool_protocol import MAX_TOOLS, ToolName
from gateway.responses_input import InputItems, chat_messages, check_items

LOGPROBS = "message.output_text.logprobs"
"""The one ``include`` value served: the output text's logprobs."""
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
"""OpenAI's bounds on metadata (echoed on the response, kept nowhere)."""

_STATELESS = "this server keeps no responses: send the whole conversation in input"

UNSUPPORTED: Mapping[str, Unsupported] = {
    "store": Unsupported((False,), _STATELESS),
    "previous_response_id": Unsupported((), _STATELESS),
    "conversation": Unsupported((), _STATELESS),
    "background": Unsupported((False,), "a response is served while its request is open"),
    "reasoning": Unsupported((), "the model does not reason in a separate channel"),
    "prompt": Unsupported((), "no stored prompt templates: send the text in input"),
    "truncation": Unsupported(("disabled",), "an input longer than the context is refused "
                                             "(400), never cut"),
    "service_tier": Unsupported(("auto", "default"), "one tier"),
    "max_tool_calls": Unsupported((), "not implemented"),
    "stream_options": Unsupported(({"include_obfuscation": False},), "events are not padded"),
    "prompt_cache_retention": Unsupported(("in_memory", "in-memory"), "cached blocks live in "
                                                                     "the engines' memory only"),
}
"""Fields accepted at their neutral values only (gateway/openai_fields.py's rule)."""

PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "top_logprobs", "user",
          "safety_identifier", "top_k", "min_p", "min_tokens", "seed", "stop",
          "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "ignore_eos",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
          "bad_words", "allowed_token_ids", "cache_salt", "priority", "prompt_cache_key")
"""Fields passed to the chat request as they came (it validates them)."""

RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "response_format": "text",
           "logprobs": "include", "stream_options": "stream"}
"""Chat's names of the fields translated here -> the Responses API's names (for errors)."""


class FunctionTool(BaseModel):
    """A function tool in the Responses API's flat shape."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: ToolName
    description: Annotated[Text, Field(max_length=MAX_SPEC_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def to_chat(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": self.parameters, "strict": self.strict}}


class FunctionChoice(StrictRequest):
    """tool_choice naming one function: {"type": "function", "name": ...}."""

    type: Literal["function"]
    name: ToolName


class TextFormat(StrictRequest):
    """text.format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[Text, Field(min_length=1, max_length=256)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise InvalidField("text", "text.format takes a schema with type json_schema, "
                                       "and only then")
        return self

    def to_chat(self) -> dict[str, Any]:
        """As chat's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {
            "name": self.name or "response", "schema": self.schema_, "strict": self.strict,
            "description": self.description}}


class TextConfig(StrictRequest):
    """The text object: its format, and OpenAI's verbosity at its default only."""

    format: TextFormat | None = None
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = {
        "verbosity": Unsupported(("medium",), "not implemented")}


class ResponsesRequest(StrictRequest):
    """POST /v1/responses; ``chat_request()`` is the chat request that serves it."""

    WHOLE_BODY: ClassVar[bool] = True

    input: InputItems
    """Messages and function call items (a string: one user message)."""
    instructions: Text | None = None
    """A system message before the input (bounded as chat's messages are: by the body's
    size, then by the context)."""
    max_output_tokens: Any = None
    """Chat's max_completion_tokens."""
    stream: StrictBool = False
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    """Empty as none (the openai-agents SDK sends [] for an agent without tools)."""
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    include: Annotated[list[Literal["message.output_text.logprobs"]],
                       Field(max_length=8)] | None = None
    metadata: dict[str, str] | None = None
    # As chat takes them (PASSED), validated by ChatCompletionRequest:
    model: Any = None
    temperature: Any = None
    top_p: Any = None
    parallel_tool_calls: Any = None
    top_logprobs: Any = None
    user: Any = None
    safety_identifier: Any = None
    top_k: Any = None
    min_p: Any = None
    min_tokens: Any = None
    seed: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    ignore_eos: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    cache_salt: Any = None
    priority: Any = None
    prompt_cache_key: Any = None
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = UNSUPPORTED
    _chat: ChatCompletionRequest | None = PrivateAttr(default=None)

    @field_validator("input", mode="before")
    @classmethod
    def _input_bounded(cls, value: Any) -> Any:
        return check_items(value)

    # The refusals below are InvalidFields: each message names its field already.
    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        for tool in value if isinstance(value, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise InvalidField("tools", f"tools of type {kind[:32]!r} are not supported: "
                                            "function tools only (this server runs no "
                                            "built-in tools)")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise InvalidField("tool_choice", f"tool_choice of type {kind[:32]!r} is not "
                                              "supported: none, auto, required or "
                                              "{\"type\": \"function\", \"name\": ...}")
        return value

    @field_validator("include", mode="before")
    @classmethod
    def _logprobs_only(cls, value: Any) -> Any:
        for entry in value if isinstance(value, list) else []:
            if isinstance(entry, str) and entry != LOGPROBS:
                raise InvalidField("include", f"include {entry[:64]!r} is not supported: "
                                              f"only {LOGPROBS!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _stream_options_with_stream(cls, data: Any) -> Any:
        # As chat refuses them (stream_options is checked in the UNSUPPORTED table, not kept).
        if isinstance(data, dict) and data.get("stream_options") is not None \
                and data.get("stream") is not True:
            raise InvalidField("stream_options", "stream_options is only allowed with "
                                                 "stream=true")
        return data

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_bounded(cls, value: Any) -> Any:
        # Checked whole here, so every problem is located at metadata (a key is no field).
        if value is None:
            return None
        problem = _metadata_problem(value)
        if problem is not None:
            raise InvalidField("metadata", f"metadata {problem}")
        return value

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or [])

    @model_validator(mode="after")
    def _as_chat(self) -> ResponsesRequest:
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise InvalidField("top_logprobs", f"top_logprobs needs include: [{LOGPROBS!r}]")
        try:
            self._chat = ChatCompletionRequest.model_validate(self._chat_body())
        except ValidationError as exc:
            raise _refusal(exc) from None
        return self

    def _chat_body(self) -> dict[str, Any]:
        body = {name: getattr(self, name) for name in PASSED if name in self.model_fields_set}
        body["messages"] = chat_messages(self.instructions, self.input)
        if "max_output_tokens" in self.model_fields_set:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.stream:  # the usage comes in the chat stream's last event
            body.update(stream=True, stream_options={"include_usage": True})
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.to_chat()
        if self.tools:
            body["tools"] = [tool.to_chat() for tool in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.logprobs:
            body["logprobs"] = True
        return body

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completions request that serves this one (built once, validated)."""
        assert self._chat is not None, "validated requests have their chat request"
        return self._chat


def _refusal(exc: ValidationError) -> InvalidField:
    """The chat request's refusal, about the field as this API names it: said as the chat
    route says it (engine/http/errors.py), then renamed where the translation renamed."""
    message, param = describe_errors(exc.errors())
    field, message = as_named_here(param or "input", message)
    flat = re.match(r"tools\.\[(\d+)\]\.function\.", field)
    if flat is not None:  # a function's own field: where this API's flat tool holds it
        field = f"tools.[{flat[1]}]." + field[flat.end():]
        message = re.sub(r"tools\[(\d+)\]\.function\.", r"tools[\1].", message)
    return InvalidField(field, message)


def as_named_here(param: str, message: str) -> tuple[str, str]:
    """A chat error's param and message, naming the field as this API does (``input``, not
    ``messages``) where the translation renamed it."""
    new = RENAMED.get(param)
    if new is None:
        return param, message
    # "messages": the first mention only, which names the field ("messages holds 4097
    # messages"); another name is only ever the field's ("lower max_completion_tokens").
    return new, re.sub(rf"\b{re.escape(param)}\b", new, message,
                       count=1 if param == "messages" else 0)


def _metadata_problem(value: Any) -> str | None:
    """What is wrong with a metadata object (None: nothing), after "metadata "."""
    if not isinstance(value, dict):
        return "is an object of string keys and string values"
    if len(value) > MAX_METADATA_PAIRS:
        return f"holds {len(value)} pairs, more than {MAX_METADATA_PAIRS}"
    for key, text in value.items():
        if not isinstance(text, str):
            return f"values are strings ({key[:64]!r} is not)"
        if len(key) > MAX_METADATA_KEY:
            return f"keys have at most {MAX_METADATA_KEY} characters"
        if len(text) > MAX_METADATA_VALUE:
            return f"values have at most {MAX_METADATA_VALUE} characters"
        valid_text(key)
        valid_text(text)
    return None
