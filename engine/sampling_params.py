"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.invalid_field import InvalidField
from engine.structured_output import StructuredOutput

MAX_SEED = 2**64
"""Seeds are in [0, MAX_SEED): what a torch generator accepts."""
MAX_INT_FIELD = 2**31 - 1
"""Bound of every other integer field (max_tokens, top_k, token ids): far above any real
value, and small enough for every tensor dtype the sampler uses."""
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024
GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (dividing logits by them overflows)."""
MAX_TOKEN_LISTS = 4096
"""Most entries of logit_bias, allowed_token_ids or bad words (each bounds per-step work)."""

MIN_REPETITION_PENALTY = 0.01
"""Smallest repetition_penalty (1 disables it): a seen token's positive logit is divided by
it, and a tiny one overflows float32 (1e-300 made every logit infinite: NaN probabilities,
gibberish). vLLM takes any value > 0."""
MAX_REPETITION_PENALTY = 100.0
"""Largest repetition_penalty: a seen token's negative logit is multiplied by it, which stays
finite in float32 far past this; the mirror of the smallest, and past any penalty in use
(vLLM has no bound)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters, validated at construction.

    temperature == 0 (or below GREEDY_BELOW) means greedy (top_k / top_p / min_p / seed are
    then ignored); top_k 0 or -1 disables top-k. ``seed`` gives the
    request its own generator, so its samples do not depend on which other requests share
    its batches. ``logprobs``: None returns no logprobs; k >= 0 returns the chosen token's
    logprob plus the k most likely alternatives (of the model's raw distribution, before
    any of the adjustments below).

    Logit adjustments, in the order applied (as vLLM does; engine/logits_processors.py):
    allowed_token_ids (every other token banned), bad_words (a word's last token banned
    where the output so far ends with the rest of it), min_tokens (end-of-sequence and
    stop_token_ids banned, stop strings not matched, before that many output tokens),
    logit_bias (added per token id), then the penalties: repetition_penalty (> 1 makes
    every token of the prompt or output less likely: positive logits divided, negative
    multiplied), frequency_penalty (subtracted once per earlier output occurrence) and
    presence_penalty (subtracted once if it occurred). min_p: after temperature, tokens
    with less than min_p times the top token's probability are dropped.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    """None: none; k >= 0: each prompt token's logprob (after the first), its rank, and the
    k most likely tokens at its position (the model's raw distribution). Such a request
    computes its whole prompt: it takes nothing from the prefix cache, as vLLM does."""
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text (by default it is cut off)."""
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    """(token id, bias in [-100, 100]) pairs; a dict is accepted too."""
    allowed_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """When not empty, the only tokens that may be sampled."""
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    """Words never generated; tokenized by the engine into bad_words_token_ids."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    """Token sequences never generated (bad_words as the engine's tokenizer spells them)."""
    structured: StructuredOutput | None = None
    """What the text must match (engine/structured_output.py); a dict is accepted too."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a lone string is a common slip: accept it as one stop
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "bad_words_token_ids",
                           tuple(tuple(word) for word in self.bad_words_token_ids))
        if isinstance(self.structured, dict):
            object.__setattr__(self, "structured", StructuredOutput(**self.structured))
        if self.structured is not None and self.ignore_eos:
            raise InvalidField("ignore_eos", "ignore_eos cannot be combined with structured "
                               "outputs: the grammar's end is an end-of-sequence token")
        if self.top_k == -1:  # vLLM's spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        if self.n != 1:
            raise ValueError(f"n must be 1 (one completion per request), got {self.n}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT_FIELD:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_INT_FIELD}], got "
                             f"{self.max_tokens!r}")
        if (not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature)
                or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT_FIELD:
            raise ValueError(f"top_k must be an integer in [0, {MAX_INT_FIELD}] (0 or -1 "
                             f"disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer between 0 and 20, got "
                             f"{self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer between 0 and 20, got "
                             f"{self.prompt_logprobs!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_LENGTH for s in self.stop):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of "
                             f"at most {MAX_STOP_LENGTH} characters")
        if any(not _is_int(t) or not 0 <= t <= MAX_INT_FIELD for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {MAX_INT_FIELD}], got "
                             f"{self.stop_token_ids!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidField("min_tokens", f"min_tokens must be an integer in [0, max_tokens "
                               f"({self.max_tokens})], got {self.min_tokens!r}")
        _number_in("min_p", self.min_p, 0.0, 1.0)
        _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number_in("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                   MAX_REPETITION_PENALTY)
        # A bad word is banned in up to two spellings (alone, after a space).
        for name, values, most in (
                ("logit_bias", self.logit_bias, MAX_TOKEN_LISTS),
                ("allowed_token_ids", self.allowed_token_ids, MAX_TOKEN_LISTS),
                ("bad_words", self.bad_words, MAX_TOKEN_LISTS),
                ("bad_words_token_ids", self.bad_words_token_ids, 2 * MAX_TOKEN_LISTS)):
            if len(values) > most:
                raise ValueError(f"{name} may have at most {most} entries")
        for token, value in self.logit_bias:
            if not _is_int(token) or not 0 <= token <= MAX_INT_FIELD:
                raise ValueError(f"logit_bias keys must be token ids in [0, {MAX_INT_FIELD}], "
                                 f"got {token!r}")
            _number_in("a logit_bias value", value, -100.0, 100.0)
        if any(not _is_int(t) or not 0 <= t <= MAX_INT_FIELD for t in self.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be integers in [0, {MAX_INT_FIELD}]")
        if any(not isinstance(w, str) or not 0 < len(w) <= MAX_STOP_LENGTH
               for w in self.bad_words):
            raise ValueError(f"bad_words must be non-empty strings of at most "
                             f"{MAX_STOP_LENGTH} characters")
        if any(not word or len(word) > MAX_STOP_LENGTH
               or any(not _is_int(t) or not 0 <= t <= MAX_INT_FIELD for t in word)
               for word in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty lists of token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether a penalty needs the request's token counts."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit adjustment before sampling applies (min_p aside)."""
        return bool(self.penalized or self.min_tokens or self.logit_bias
                    or self.allowed_token_ids or self.bad_words_token_ids)


def _number_in(name: str, value: object, low: float, high: float) -> None:
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or not low <= value <= high):
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
