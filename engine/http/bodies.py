"""Request bodies of the engine's HTTP API (pydantic: only at this edge). A /generate body
becomes an engine/protocol.py GenerateRequest, whose SamplingParams validates the sampling
fields again."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from engine.http.json_numbers import Float, Int


class SamplingBody(BaseModel):
    """Sampling fields of /generate (the engine's SamplingParams, validated there too)."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: Int = 16
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Int = 0
    seed: Int | None = None
    stop: list[str] = Field(default_factory=list, max_length=64)
    stop_token_ids: list[Int] = Field(default_factory=list, max_length=256)
    ignore_eos: StrictBool = False
    logprobs: Int | None = None
    prompt_logprobs: Int | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    min_tokens: Int = 0
    min_p: Float = 0.0
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    repetition_penalty: Float = 1.0
    logit_bias: list[tuple[Int, Float]] = Field(default_factory=list, max_length=4096)
    allowed_token_ids: list[Int] = Field(default_factory=list, max_length=4096)
    bad_words: list[str] = Field(default_factory=list, max_length=4096)
    bad_words_token_ids: list[list[Int]] = Field(default_factory=list, max_length=8192)
    structured: StructuredBody | None = None


class StructuredBody(BaseModel):
    """engine/structured_output.py StructuredOutput."""

    model_config = ConfigDict(extra="forbid")
    kind: str
    spec: str = ""
    choices: list[str] = Field(default_factory=list, max_length=1024)
    any_whitespace: StrictBool = True
    param: str = Field(default="structured_outputs", min_length=1, max_length=64)
    best_effort: StrictBool = False


class GenerateBody(BaseModel):
    """POST /generate: exactly one of prompt / prompt_token_ids."""

    model_config = ConfigDict(extra="forbid")
    request_id: str | None = Field(default=None, max_length=256)
    prompt: str | None = None
    prompt_token_ids: list[Int] | None = None
    params: SamplingBody = Field(default_factory=SamplingBody)
    lora: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    priority: Int = 0
    deadline: Float | None = None
    """Unix time after which the engine stops working on the request."""
    tenant: str | None = Field(default=None, max_length=256)
    """Whom the engine's preparing thread is fair to (GenerateRequest.tenant)."""
    lora_digest: str | None = Field(default=None, max_length=128)
    """The weights meant by ``lora`` (GenerateRequest.adapter_digest)."""
    stream: StrictBool = True


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=4096)


class PinBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pinned: StrictBool = True
