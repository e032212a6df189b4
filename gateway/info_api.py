"""The endpoints that describe the model and its tokenizer without generating: GET /v1/models,
GET /v1/models/{id}, and, as vLLM's OpenAI server has them, POST /tokenize, POST /detokenize
and GET /tokenizer_info.

/tokenize returns exactly the ids a completion or chat request with the same prompt or
messages would send to the engine (the same PromptEncoder), so a client can count tokens
before it asks. The caller needs the same key as for /v1/completions, and a model it cannot
see is a 404, as there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, ClassVar, Literal

from fastapi import APIRouter
from pydantic import (
    Field,
    SkipValidation,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)
from transformers import PreTrainedTokenizerBase

from engine.http.errors import ApiError
from engine.invalid_field import InvalidField, field_of
from gateway import openai_fields
from gateway.admission import Admitted, AdmittedRoute
from gateway.caller import Caller
from gateway.chat_documents import Documents
from gateway.job import Claim
from gateway.openai_chat_protocol import (
    MAX_MESSAGES,
    ChatCompletionRequest,
    ChatMessage,
    TemplateKwargs,
    check_message_counts,
)
from gateway.openai_fields import StrictRequest, Unsupported
from gateway.openai_protocol import MAX_MODEL_NAME, token_ids
from gateway.openai_text import Text
from gateway.openai_tool_protocol import MAX_TOOLS, NamedToolChoice, ToolDefinition
from gateway.prompts import PromptEncoder
from gateway.service import Gateway

CHAT_ONLY = frozenset({"add_generation_prompt", "continue_final_message",
                       "chat_template_kwargs", "tools", "tool_choice", "documents"})
"""TokenizeRequest's fields that a prompt (not messages) cannot use."""


class TokenizeRequest(StrictRequest):
    """A prompt (as /v1/completions takes it) or messages with the chat request's template
    options (as /v1/chat/completions takes them)."""

    WHOLE_BODY: ClassVar[bool] = True

    model: Annotated[Text, Field(max_length=MAX_MODEL_NAME)] | None = None
    """None: the base model (its tokenizer is every adapter's), as vLLM takes it."""
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None \
        = None
    add_special_tokens: StrictBool | None = None
    """A prompt: as /v1/completions takes it (default True); messages: False only, as the
    chat endpoint (the template places the special tokens)."""
    return_token_strs: StrictBool = False
    # With messages, as a chat request takes them (gateway/openai_chat_protocol.py):
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: TemplateKwargs | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    documents: Documents | None = None
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = openai_fields.TOKENIZE

    @model_validator(mode="before")
    @classmethod
    def _messages_bounded(cls, data: Any) -> Any:
        check_message_counts(data)
        return data

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidField("prompt" if self.prompt is None else "messages",
                               "give either prompt or messages")
        if self.messages is not None and self.add_special_tokens:
            raise InvalidField("add_special_tokens", "add_special_tokens=True is not supported "
                               "for messages: the ids are those a chat request sends (the "
                               "template places the special tokens)")
        if self.prompt is not None:
            chat_only = sorted(name for name in CHAT_ONLY & self.model_fields_set
                               if getattr(self, name) != type(self).model_fields[name].default)
            if chat_only:
                raise InvalidField(chat_only[0], f"{', '.join(chat_only)} only apply to "
                                   f"messages")
        return self

    def chat_request(self, model: str) -> ChatCompletionRequest:
        """The chat request these messages and options stand for (validated as one)."""
        return ChatCompletionRequest(
            model=model, messages=self.messages or [], tools=self.tools,
            tool_choice=self.tool_choice, add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs, documents=self.documents)


class DetokenizeRequest(StrictRequest):
    """Token ids back to text (at most a context's worth: the handler checks)."""

    model: Annotated[Text, Field(max_length=MAX_MODEL_NAME)] | None = None
    """As TokenizeRequest's."""
    tokens: Annotated[list[int], SkipValidation]

    @field_validator("tokens", mode="before")
    @classmethod
    def _ids(cls, value: Any) -> list[int]:
        """One pass over the list, however long (a validator per item costs seconds for a
        million ids, on the event loop)."""
        if not isinstance(value, list):
            raise ValueError("tokens must be a list of token ids")
        return token_ids(value, "tokens")


@contextlib.contextmanager
def counted(gateway: Gateway, claim: Claim) -> Iterator[None]:
    """A tokenizer call counts as a request against its tenant's limits (RPM, concurrency,
    a revoked key; never tokens): tokenizing is CPU work on the gateway, and a tenant over
    its limits must not be able to keep it busy here. Admitted before its body is parsed
    (AdmittedRoute); its claim ends with the call."""
    try:
        yield
    finally:
        gateway.settle(claim, 0, "refused")  # counted, charged no tokens


def model_card(gateway: Gateway, name: str, created: int) -> dict[str, Any]:
    """OpenAI's model object for the base model or one of its adapters, with vLLM's
    ``max_model_len`` (the context of the ready instances; null while none is)."""
    parent = None if name == gateway.base_model else gateway.base_model
    return {"id": name, "object": "model", "created": created, "owned_by": "loragate",
            "root": name, "parent": parent, "max_model_len": gateway.max_model_len() or None}


def build_info_router(get_gateway: Callable[[], Gateway], prompts: PromptEncoder
                      ) -> APIRouter:
    """The routes above, over the API router's prompt encoder."""
    router = APIRouter()
    tokenizer_calls = APIRouter(route_class=AdmittedRoute)  # admitted before the body
    tokenizer: PreTrainedTokenizerBase = prompts.tokenizer

    @router.get("/v1/models")
    async def list_models(principal: Caller) -> dict[str, Any]:
        gateway = get_gateway()
        created = int(time.time())
        names = [gateway.base_model, *gateway.adapter_names(principal)]
        return {"object": "list", "data": [model_card(gateway, n, created) for n in names]}

    @tokenizer_calls.post("/tokenize")
    async def tokenize(body: TokenizeRequest, principal: Caller, claim: Admitted
                       ) -> dict[str, Any]:
        gateway = get_gateway()
        with counted(gateway, claim):
            model = body.model or gateway.base_model
            gateway.resolve_model(model, principal)  # 404 for a model it cannot see
            context = gateway.context_length()
            if body.prompt is not None:
                prompts.check_chars(len(body.prompt), context, "prompt")
                ids = await prompts.encode_prompt(body.prompt, body.add_special_tokens
                                                  is not False)
            else:
                try:
                    chat = body.chat_request(model)
                except ValidationError as exc:  # options that do not agree, as a chat's
                    error = exc.errors()[0]
                    cause = (error.get("ctx") or {}).get("error")  # our own check's, if any
                    raise ApiError(400, error["msg"] if cause is None else str(cause),
                                   param=field_of(cause) or ".".join(map(str, error["loc"]))
                                   or None) from None
                ids = await prompts.encode_chat_request(chat, context)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": context, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return out

    @tokenizer_calls.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, principal: Caller, claim: Admitted
                         ) -> dict[str, str]:
        gateway = get_gateway()
        with counted(gateway, claim):
            gateway.resolve_model(body.model or gateway.base_model, principal)
            context = gateway.context_length()
            if len(body.tokens) > context:  # no request holds more: nothing to decode
                raise ApiError(400, f"tokens holds {len(body.tokens)} ids, more than the "
                               f"model's context ({context})", param="tokens")
            vocab = len(tokenizer)
            if body.tokens and max(body.tokens) >= vocab:
                raise ApiError(400, f"token id {max(body.tokens)} is outside the vocabulary "
                               f"(size {vocab})", param="tokens")
            # Decoding is CPU work: off the event loop.
            text = await asyncio.to_thread(tokenizer.decode, body.tokens)
        return {"prompt": str(text)}

    @router.get("/tokenizer_info")
    async def tokenizer_info(principal: Caller) -> dict[str, Any]:
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "vocab_size": len(tokenizer),
            "model_max_length": get_gateway().max_model_len() or None,
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
            "chat_template": tokenizer.chat_template,
        }

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, principal: Caller) -> dict[str, Any]:
        gateway = get_gateway()
        gateway.resolve_model(model_id, principal)  # 404 for a model it cannot see
        return model_card(gateway, model_id, int(time.time()))

    router.include_router(tokenizer_calls)
    return router
