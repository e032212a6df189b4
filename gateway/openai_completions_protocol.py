"""The body of POST /v1/completions: a prompt or a batch of prompts, with the sampling
fields every endpoint shares (gateway/openai_protocol.py, whose rules hold here too)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import (
    Field,
    SkipValidation,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.http.json_numbers import Int
from engine.invalid_field import InvalidField
from gateway import openai_fields
from gateway.openai_fields import Unsupported
from gateway.openai_protocol import (
    INT32_LIMIT,
    MAX_BATCH_PROMPTS,
    MAX_LOGPROBS,
    MAX_PROMPT_TOKEN_IDS,
    SampleCount,
    SamplingFields,
    token_ids,
)

Prompt = str | list[int]
"""One prompt of /v1/completions: a text or its token ids."""


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a prompt (text or token ids) or a batch of them (a list of
    texts or of token-id lists), one choice per prompt in the batch's order."""

    WHOLE_BODY: ClassVar[bool] = True

    # All checks in the validators below: pydantic's own would take another pass over a
    # list of millions of ids (on the event loop) and report every bad item.
    prompt: Annotated[list[Prompt], SkipValidation]
    """Always a list of prompts once validated (a single prompt is a batch of one)."""
    echo: StrictBool = False
    """Return the prompt before the completion (with logprobs: its tokens' logprobs too)."""
    max_tokens: Annotated[Int, Field(ge=0, lt=INT32_LIMIT)] = 16
    """0 only with echo (the prompt scored, nothing generated); null is 16, as in OpenAI, vLLM."""
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: SampleCount | None = None
    """Generate this many per prompt and return the n with the highest cumulative logprob
    (not with stream, as in OpenAI and vLLM)."""
    add_special_tokens: StrictBool = True
    """Tokenize a text prompt with the tokenizer's special tokens (e.g. BOS), as vLLM does."""
    UNSUPPORTED: ClassVar[Mapping[str, Unsupported]] = openai_fields.COMPLETIONS

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """A text, token ids, or a batch of either; one error for a bad list, however
        long."""
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list):
            raise ValueError("prompt must be a string, a list of token ids, or a list of "
                             "either (a batch)")
        if not value or isinstance(value[0], int):
            return [token_ids(value)]
        if len(value) > MAX_BATCH_PROMPTS:
            raise ValueError(f"a batch holds at most {MAX_BATCH_PROMPTS} prompts")
        if all(isinstance(p, str) for p in value):
            return value
        if all(isinstance(p, list) for p in value):
            if sum(len(p) for p in value) > MAX_PROMPT_TOKEN_IDS:
                raise ValueError(f"a batch holds at most {MAX_PROMPT_TOKEN_IDS} token ids")
            return [token_ids(p) for p in value]
        raise ValueError("a batch of prompts is a list of strings or a list of token-id lists")

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value: list[Prompt]) -> list[Prompt]:
        # A lone surrogate in a text was refused with the whole body (WHOLE_BODY).
        if any(not p for p in value):
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _nothing_to_generate(cls, value: int, info: ValidationInfo) -> int:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens=0 needs echo=true (the prompt is all the answer)")
        return value

    @model_validator(mode="after")
    def _sample_counts(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidField("best_of", f"best_of ({self.best_of}) must be at least n "
                                          f"({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise InvalidField("best_of", "best_of > n is not available with stream=true")
        if len(self.prompt) * self.samples_per_prompt > MAX_BATCH_PROMPTS:
            raise InvalidField("best_of" if self.best_of else "n", f"prompts x max(n, "
                               f"best_of) may be at most {MAX_BATCH_PROMPTS}")
        return self

    @property
    def samples_per_prompt(self) -> int:
        return max(self.n, self.best_of or 1)

    def engine_logprobs(self) -> int | None:
        """What the engine reports: the client's logprobs, or the chosen token's alone when
        best_of ranks sequences by their cumulative logprob."""
        if self.samples_per_prompt > self.n:
            return self.logprobs or 0
        return self.logprobs

    def engine_prompt_logprobs(self) -> int | None:
        """What the engine must compute: vLLM's prompt_logprobs, or echo's logprobs."""
        echoed = self.logprobs if self.echo else None
        if echoed is None or self.prompt_logprobs is None:
            return echoed if self.prompt_logprobs is None else self.prompt_logprobs
        return max(echoed, self.prompt_logprobs)
