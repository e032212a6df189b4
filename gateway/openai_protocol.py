"""Request bodies of the OpenAI-compatible API (pydantic: only at this edge).

Every field is bounded here, before any work: numbers to ranges the engine's types hold
(token ids and max_tokens below 2**31, seeds in [-2**63, 2**64)), floats finite (Python's JSON
parser accepts NaN and Infinity), text valid Unicode (a lone surrogate cannot be encoded,
and would fail the request later as a 500), lists short. A refusal is a 400 whose param
names the field, with one short error per field however large the value (a huge list of bad
items must not become a huge error body).

Fields of OpenAI's and vLLM's schemas that we do not implement (gateway/openai_fields.py)
are accepted only at their neutral value (n=1, no tools, ...):
anything else is a 400 naming the field, never a silent difference. Fields in neither place
are a 400 too ("Unrecognized request argument supplied", as OpenAI answers). Our own
extras: cache_salt, priority, top_k, ignore_eos; vLLM's sampling extras as vLLM names them
(repetition_penalty, min_p, min_tokens, stop_token_ids, bad_words, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.generation_defaults import SamplingDefaults
from engine.http.json_numbers import Float, Int
from engine.invalid_field import InvalidField
from engine.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from engine.structured_output import MAX_SPEC_CHARS, StructuredOutput
from gateway import openai_fields
from gateway.openai_fields import StrictRequest, Unsupported
from gateway.openai_structured import ResponseFormat, StructuredOutputs, field_constraint
from gateway.openai_text import Text, valid_text

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
INT32_LIMIT = 2**31
"""Token ids, max_tokens and top_k stay below this (the engine keeps them in int32/int64
tensors; no vocabulary or context comes near it)."""
SEED_LIMIT = 2**64
RANDOM_SEED = -1
"""The seed that asks for none (vLLM's reading)."""
MAX_PROMPT_TOKEN_IDS = 2**20
"""Longer than any context we serve: refused before the ids are looked at (the real bound
is the context, checked once it is known)."""
MAX_BATCH_PROMPTS = 128
"""Most engine requests one request becomes (a batch's prompts times its samples each)."""
MAX_SAMPLES = 128
"""Most sequences per prompt (n, best_of): OpenAI's bound on n (a batch's prompts times
their samples stay within MAX_BATCH_PROMPTS)."""
MAX_MODEL_NAME = 512
MAX_LOGPROBS = 20
"""Most alternatives per position (logprobs, top_logprobs, prompt_logprobs): vLLM's default
max_logprobs, which its clients expect (OpenAI's completions take 5)."""
MAX_CONTENT_PARTS = 4096
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs",
    "return_assistant_tokens_mask", "add_generation_prompt", "continue_final_message"})
"""apply_chat_template's own parameters: a template variable of that name would change how
the prompt is built or tokenized, not what the template renders."""
MAX_TOKEN_LIST = 4096
"""Most entries of logit_bias, allowed_token_ids, bad_words, stop_token_ids."""


SampleCount = Annotated[Int, Field(ge=1, le=MAX_SAMPLES)]
TokenId = Annotated[Int, Field(ge=0, lt=INT32_LIMIT)]
MaxTokens = Annotated[Int, Field(ge=1, lt=INT32_LIMIT)]


StreamUsage = Literal["none", "last_chunk", "every_chunk"]


class StreamOptions(StrictRequest):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    """vLLM's: with include_usage, every chunk carries the usage so far (not null)."""
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = openai_fields.STREAM_OPTIONS


Stop = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_LENGTH)] | Annotated[
    list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_LENGTH)]],
    Field(max_length=MAX_STOP_STRINGS)]


class SamplingFields(StrictRequest):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(allow_inf_nan=False)
    model: Annotated[Text, Field(max_length=MAX_MODEL_NAME)] = ""
    """The base model or an adapter; left out (or empty): the base model, as vLLM serves its
    first model (the handler fills it in)."""
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=-1, lt=INT32_LIMIT,
                              description="-1 or 0: no top-k (vLLM's and ours)")
    seed: Int | None = Field(default=None, ge=-2**63, lt=SEED_LIMIT)
    """Any 64-bit integer, signed or not, as OpenAI and vLLM take it: -1 means no seed (as in
    vLLM: many UIs send it for "random"), others draw with their value modulo 2**64."""
    stop: Stop | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: SampleCount = 1
    """Choices per prompt, sampled independently (index = prompt's place * n + j)."""
    user: Annotated[Text, Field(max_length=256)] | None = None
    """The end user's id, for telling abuse apart: logged on the access line (user=)."""
    safety_identifier: Annotated[Text, Field(max_length=256)] | None = None
    """OpenAI's newer name for ``user``."""
    ignore_eos: StrictBool = False
    cache_salt: Annotated[Text, Field(min_length=1, max_length=256)] | None = None
    prompt_cache_key: Annotated[Text, Field(max_length=1024)] | None = None
    """OpenAI's: requests with the same key (and cache salt and adapter) are routed where the
    last of them went, as if it held their prompt cached (gateway/cache_key_affinity.py)."""
    priority: Int = Field(default=0, ge=-1000, le=1000)
    return_token_ids: StrictBool = False
    """vLLM's: the prompt's and the generated token ids beside the text."""
    return_tokens_as_token_ids: StrictBool = False
    """vLLM's: logprob tokens as "token_id:<id>" (for tokens that are not valid text)."""
    presence_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, Annotated[Float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_TOKEN_LIST)] | None = None
    """OpenAI's map of token id (a decimal string) to a bias added to its logit."""
    # vLLM's sampling extras
    repetition_penalty: Float | None = Field(default=None, ge=MIN_REPETITION_PENALTY,
                                             le=MAX_REPETITION_PENALTY)
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: Int = Field(default=0, ge=0, lt=INT32_LIMIT)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_LIST)] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_LIST)
                                 ] | None = None
    """Empty would allow no token at all: refused (leave it out for no restriction)."""
    bad_words: Annotated[list[Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LENGTH)]],
                         Field(max_length=MAX_TOKEN_LIST)] | None = None
    truncate_prompt_tokens: Int | None = Field(default=None, ge=-1, lt=INT32_LIMIT)
    """Keep only the prompt's last this many tokens (after the chat template, if any); -1:
    as many as the context holds beside one output token (vLLM's)."""
    prompt_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: each prompt token's logprob and the k most likely tokens at its position
    (completions: on each choice; chat: on the response). Not with stream, as in vLLM."""
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields; at most one constraint per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Annotated[Text, Field(max_length=MAX_SPEC_CHARS)] | None = None
    guided_choice: Annotated[list[Annotated[Text, Field(min_length=1)]],
                             Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: Annotated[Text, Field(max_length=MAX_SPEC_CHARS)] | None = None

    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = openai_fields.SHARED

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo
                             ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream=true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs is not available with stream=true")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, value: str | list[str] | None) -> str | list[str] | None:
        for text in [value] if isinstance(value, str) else value or []:
            valid_text(text)
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_some(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be at least 1, or -1 for as many tokens as the context "
                             "holds beside the output")
        return value

    @field_validator("logit_bias", "stop_token_ids", "allowed_token_ids", "bad_words",
                     mode="before")
    @classmethod
    def _short_list(cls, value: Any, info: ValidationInfo) -> Any:
        # Before the items are looked at: 100,000 bad items must be one error, not 100,000.
        if isinstance(value, list | dict) and len(value) > MAX_TOKEN_LIST:
            raise ValueError(f"{info.field_name} may have at most {MAX_TOKEN_LIST} entries")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            # isdigit() alone takes other scripts' digits ("١", "²"), which int() reads or not
            if not (key.isascii() and key.isdigit()) or int(key) >= INT32_LIMIT:
                raise ValueError(f"logit_bias keys must be token ids, got {key[:32]!r}")
        if value and len({int(key) for key in value}) < len(value):  # "1" and "01"
            raise ValueError("logit_bias names a token id twice")
        return value

    def sampling_args(self, defaults: SamplingDefaults) -> dict[str, Any]:
        """The sampling fields as SamplingParams arguments (all but max_tokens, seed, stop,
        logprobs and the constraint); a field left unset takes the model's recommended
        value from ``defaults`` where it has one, else OpenAI's / vLLM's default."""

        def pick(given: float | None, recommended: float | None, fallback: float) -> float:
            return given if given is not None else (
                recommended if recommended is not None else fallback)

        return {
            "temperature": pick(self.temperature, defaults.temperature, 1.0),
            "top_p": pick(self.top_p, defaults.top_p, 1.0),
            # -1 (vLLM's "off") is the engine's 0
            "top_k": max(0, int(pick(self.top_k, defaults.top_k, 0))),
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": pick(self.repetition_penalty, defaults.repetition_penalty,
                                       1.0),
            "min_p": pick(self.min_p, defaults.min_p, 0.0),
            "min_tokens": self.min_tokens,
            "logit_bias": tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "allowed_token_ids": tuple(self.allowed_token_ids or ()),
            "bad_words": tuple(self.bad_words or ()),
        }

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        chosen = [(name, spec) for name, spec in self._constraints() if spec is not None]
        given = [name for name, _ in chosen]
        if len(given) > 1:
            raise InvalidField(given[-1], f"one structured output constraint per request, "
                                          f"got {', '.join(given)}")
        if self.structured_outputs is not None:
            self.structured_outputs.check_options(self._compact_json_elsewhere() or any(
                spec.kind in ("json", "json_object") for _, spec in chosen))
        return self

    def _compact_json_elsewhere(self) -> bool:
        """Whether the request's output is single-line JSON by another field (a forced tool
        call's), which disable_any_whitespace then asks for as well."""
        return False

    def _constraints(self) -> list[tuple[str, StructuredOutput | None]]:
        """Each structured-output field and the constraint it asks for (None: none); a
        constraint that cannot be is an InvalidField naming its field."""
        fmt, so = self.response_format, self.structured_outputs
        whitespace = so is None or not so.disable_any_whitespace
        from_format = None if fmt is None else fmt.constraint(whitespace)
        from_vllm = None if so is None else so.constraint()
        return [
            ("response_format", from_format), ("structured_outputs", from_vllm),
            ("guided_json", None if self.guided_json is None else
             field_constraint("guided_json", "json", self.guided_json,
                              any_whitespace=whitespace)),
            ("guided_regex", None if self.guided_regex is None else
             field_constraint("guided_regex", "regex", self.guided_regex)),
            ("guided_choice", None if self.guided_choice is None else
             field_constraint("guided_choice", "choice", choices=tuple(self.guided_choice))),
            ("guided_grammar", None if self.guided_grammar is None else
             field_constraint("guided_grammar", "grammar", self.guided_grammar)),
        ]

    def structured_output(self) -> StructuredOutput | None:
        """The request's one structured-output constraint, if any."""
        return next((spec for _, spec in self._constraints() if spec is not None), None)

    @property
    def samples_per_prompt(self) -> int:
        """Sequences generated per prompt (best_of where it is larger than n)."""
        return self.n

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stream_usage(self) -> StreamUsage:
        """Where a stream reports usage: nowhere, a last chunk, or also every chunk."""
        options = self.stream_options
        if options is None or not options.include_usage:
            return "none"
        return "every_chunk" if options.continuous_usage_stats else "last_chunk"


def token_ids(value: list[Any], what: str = "a prompt") -> list[int]:
    """A list of token ids checked in one pass (ValueError for the first bad one)."""
    if len(value) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"{what} holds at most {MAX_PROMPT_TOKEN_IDS} token ids")
    if not set(map(type, value)) <= {int}:
        raise ValueError(f"{what} of token ids must be a list of integers")
    if value and (min(value) < 0 or max(value) >= INT32_LIMIT):
        raise ValueError(f"token ids must be in [0, {INT32_LIMIT})")
    return value
