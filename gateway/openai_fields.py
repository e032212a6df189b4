"""The request fields of OpenAI's completions and chat completions schemas, and vLLM's extra
parameters (and of the objects and bodies beside them: stream_options, structured_outputs,
/tokenize), that loragate does not implement: each is accepted only at a value that means
"off" (its neutral values), and anything else is a 400 naming the field, never a silent
difference. The fields it implements are the pydantic models' own (gateway/openai_protocol.py);
tests/openai_api/test_fields.py walks both tables.

A field in neither table is refused too, as OpenAI refuses it ("Unrecognized request
argument supplied"): a client that sends a vendor extension we do not know learns that it had
no effect instead of getting an answer that silently ignored it. Nested objects (messages,
tools) keep ignoring keys they do not know, so a client can send back a message object the
API returned, with all its fields.
"""

from __future__ import annotations

import json
import types
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidatorFunctionWrapHandler, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from engine.invalid_field import InvalidField
from gateway.openai_text import lone_surrogate_at


@dataclass(frozen=True)
class Unsupported:
    """A field we do not implement: the values that leave a request unchanged, and why."""

    neutral: tuple[Any, ...]
    """Values accepted (None is always accepted too, and so are empty lists and maps unless
    empty_asks or the field takes only scalars: an empty list is no boolean)."""
    reason: str
    """Completes "NAME is not supported: ..."."""
    empty_asks: bool = False
    """An empty list or map asks for the feature (web_search_options: {} turns web search
    on in OpenAI's API): refused like any other value."""

    def allows(self, value: Any) -> bool:
        if value is None:
            return True
        if isinstance(value, list | dict) and not value and not self.empty_asks:
            return not self.neutral or any(isinstance(n, list | dict) for n in self.neutral)
        return any(_same(value, n) for n in self.neutral)


def _same(value: Any, neutral: Any) -> bool:
    """value == neutral, except that a bool only equals a bool (True is not 1)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    if isinstance(value, int | float) and isinstance(neutral, int | float):
        return bool(value == neutral)
    return type(value) is type(neutral) and bool(value == neutral)


def _off(*neutral: Any, reason: str = "") -> Unsupported:
    return Unsupported(neutral, reason or "not implemented yet")


_NO_TOOLS = "the legacy functions API: use tools and tool_choice"
_NO_STORE = "loragate stores no completions"

SHARED: Mapping[str, Unsupported] = {
    # OpenAI
    "store": _off(False, reason=_NO_STORE),
    "metadata": _off(reason=_NO_STORE + " (metadata tags stored completions)"),
    "service_tier": _off("auto", "default", reason="one tier"),
    "prompt_cache_retention": _off("in_memory", "in-memory",
                                   reason="cached blocks live in the engines' memory only"),
    # vLLM's sampling extras
    "use_beam_search": _off(False, reason="no beam search"),
    "length_penalty": _off(1, reason="no beam search"),
    # Either value decodes alike: a fast tokenizer's decoder joins special tokens as it
    # joins any other, so neither transformers nor vLLM inserts spaces between them.
    "spaces_between_special_tokens": _off(True, False, reason="special tokens are decoded "
                                                              "as the tokenizer joins them"),
    "logits_processors": _off(reason="no custom logits processors"),
    "guided_decoding_backend": _off("auto", "xgrammar",
                                    reason="structured outputs use xgrammar"),
    "guided_whitespace_pattern": _off(reason="JSON follows xgrammar's whitespace rules"),
    "kv_transfer_params": _off(reason="no disaggregated prefill"),
    "ec_transfer_params": _off(reason="no disaggregated encoding"),
    "vllm_xargs": _off(reason="no vLLM plugins"),
    "request_id": _off(reason="the gateway names each request itself (x-request-id)"),
    "session_id": _off(reason="requests are routed by their prompts' cached prefixes"),
    "thinking_token_budget": _off(reason="the model does not reason in a separate channel"),
    "watermarking": _off(reason="no watermarking"),
    "truncation_side": _off("left", reason="truncate_prompt_tokens keeps the prompt's last "
                                           "tokens"),
    "logprob_token_ids": _off(reason="logprobs report the most likely tokens"),
    "return_token_offsets": _off(False, reason="not implemented"),
    "repetition_detection": _off(reason="not implemented"),
    "stream_interval": _off(1, reason="streams send every token as it is decoded"),
    "routed_experts_prompt_start": _off(0, reason="no mixture-of-experts routing"),
    "mm_payload": _off("tensors", reason="text only"),
    "return_mm_kwargs": _off(False, reason="text only"),
}
"""Both endpoints."""

COMPLETIONS: Mapping[str, Unsupported] = {
    **SHARED,
    "suffix": _off("", reason="no fill-in-the-middle"),
    "prompt_embeds": _off(reason="prompts are text or token ids"),
}
"""POST /v1/completions."""

CHAT: Mapping[str, Unsupported] = {
    **SHARED,
    "best_of": _off(1, reason="best_of is a completions parameter (use n here)"),
    "functions": _off(reason=_NO_TOOLS),
    "function_call": _off("none", reason=_NO_TOOLS),
    "audio": _off(reason="text only"),
    "modalities": _off(["text"], reason="text only"),
    "prediction": _off(reason="no predicted outputs"),
    "reasoning_effort": _off(reason="the model does not reason in a separate channel"),
    "verbosity": _off("medium", reason="not implemented"),
    "web_search_options": Unsupported((), "no web search", empty_asks=True),
    "moderation": _off(reason="no moderation"),
    "prompt_cache_options": _off(reason="the router places requests by their prompts' cached "
                                        "prefixes"),
    "add_special_tokens": _off(False, reason="the chat template places special tokens"),
    "chat_template": _off(reason="the model's own chat template is used"),
    "mm_processor_kwargs": _off(reason="text only"),
    "media_io_kwargs": _off(reason="text only"),
    "include_reasoning": _off(True, False, reason="the model does not reason in a separate "
                                                  "channel"),
    "return_prompt_text": _off(False, reason="not implemented"),
}
"""POST /v1/chat/completions."""

STREAM_OPTIONS: Mapping[str, Unsupported] = {
    "include_obfuscation": _off(False, reason="chunks are not padded"),
}
"""The stream_options object."""

STRUCTURED_OUTPUTS: Mapping[str, Unsupported] = {
    "whitespace_pattern": _off(reason="JSON follows xgrammar's whitespace rules "
                                      "(disable_any_whitespace: single-line JSON)"),
}
"""The structured_outputs object (vLLM's)."""

TOKENIZE: Mapping[str, Unsupported] = {name: CHAT[name]
                                       for name in ("chat_template", "mm_processor_kwargs")}
"""POST /tokenize (vLLM's fields for it that loragate does not implement)."""


class StrictRequest(BaseModel):
    """A request body that refuses what it does not implement: a key that is neither one of
    the model's fields nor in its UNSUPPORTED table, or a field of that table at a value other
    than its neutral ones, is a ValidationError naming the field (a 400 at the HTTP edge)."""

    model_config = ConfigDict(extra="ignore")  # every unknown key was refused already
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = {}
    """The endpoint's table of fields accepted at their neutral value only."""
    WHOLE_BODY: ClassVar[bool] = False
    """Whether this model is a request's whole body: its text is checked for lone surrogates
    everywhere first, keys and free-form fields too (once, not again in its parts)."""

    @model_validator(mode="wrap")
    @classmethod
    def _refuse_unsupported(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # Before the fields: a refused field is the one error, whatever else is wrong.
        # A field's wire name: its alias where it has one ("json", not "json_", which
        # pydantic would drop unread: a constraint silently ignored).
        if cls.WHOLE_BODY and (found := lone_surrogate_at(data)) is not None:
            path, in_key = found
            what = f"a key in {path}" if in_key and path else "a field name" if in_key \
                else path
            raise InvalidField(path or "body", f"{what} contains a lone UTF-16 surrogate: not "
                               "valid Unicode text")
        known = {field.alias or name for name, field in cls.model_fields.items()}
        check_unsupported(data, cls.UNSUPPORTED, known, cls.__name__)
        return handler(_nulls_as_unset(data, _defaulted_non_nullable(cls)))


def _nulls_as_unset(data: Any, names: frozenset[str]) -> Any:
    """``data`` without the keys in ``names`` whose value is null. OpenAI's schemas mark
    most optional fields nullable (``"stream": null``, ``"n": null`` mean the default), and
    clients that write out every field send them so."""
    if not isinstance(data, dict) or not any(data.get(n, 0) is None for n in names):
        return data
    return {k: v for k, v in data.items() if not (v is None and k in names)}


@cache
def _defaulted_non_nullable(model: type[BaseModel]) -> frozenset[str]:
    """Wire names of ``model``'s fields that have a default but do not take None:
    for them null can only mean "the default". A field that takes None keeps its null, which
    may differ from its default (chat's max_tokens: null is "up to the context")."""
    names: set[str] = set()
    for name, field in model.model_fields.items():
        if not field.is_required() and not _takes_none(field.annotation):
            names.add(field.alias or name)
    return frozenset(names)


def _takes_none(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin is Annotated:
        return _takes_none(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return any(_takes_none(arg) for arg in get_args(annotation))
    return annotation is None or annotation is type(None) or annotation is Any


def check_unsupported(data: Any, table: Mapping[str, Unsupported], known: Collection[str],
                      model: str) -> None:
    """Raise a ValidationError located at the first field of ``data`` (a raw JSON object)
    that is neither ``known`` (the fields the endpoint implements) nor in ``table``, or set
    to a value ``table`` does not accept; the error names the field and says why."""
    if not isinstance(data, dict):
        return
    for name, value in data.items():
        unsupported = table.get(name)
        if unsupported is None and name not in known:
            detail = f"Unrecognized request argument supplied: {_name(name)}"
        elif unsupported is not None and not unsupported.allows(value):
            allowed = ", ".join(json.dumps(n) for n in unsupported.neutral)  # as sent
            detail = f"{name} is not supported: {unsupported.reason}" + (
                f" (allowed: {allowed})" if allowed else "")
        else:
            continue
        raise ValidationError.from_exception_data(model, [InitErrorDetails(
            type=PydanticCustomError("unsupported_field", detail), loc=(_name(name),),
            input=_short(value))])


def _short(value: Any) -> Any:
    """The refused value as the error may carry it: a huge list or map is not echoed."""
    return value if not isinstance(value, list | dict | str) or len(value) <= 16 else "..."


def _name(name: str) -> str:
    """A field name as an error may carry it: a huge one is cut."""
    return name if len(name) <= 64 else name[:61] + "..."
