"""Prompts in, validated Requests out: tokenizing, the checks a request must pass before it
may enter the scheduler, bad-word spellings and grammars.

Any thread may build a request (the async engine does so off the engine's thread): nothing
here changes engine state. The grammar compiler is built on first use under a lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

from transformers import GenerationConfig, PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.invalid_field import InvalidField
from engine.kv_cache import KVCacheManager
from engine.models.shape import ModelShape
from engine.request import Request, RequestTiming
from engine.sampling_params import MAX_STOP_LENGTH, MAX_TOKEN_LISTS, SamplingParams
from engine.structured_output import GrammarCompiler
from lora.manager import LoraManager
from prefix_cache.hashing import request_extra_keys
from prefix_cache.pools import BASE_POOL


def eos_token_ids(config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokens that end a generation: the tokenizer's EOS, the model's generation config's
    (instruction models often list their end-of-turn marker there) and the configured
    extra stop tokens."""
    ids: set[int] = set(config.extra_stop_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if (Path(config.model) / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(config.model).eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


class RequestBuilder:
    """Builds the Requests of one engine (its tokenizer, vocabulary, context and KV cache)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model_shape: ModelShape,
                 max_model_len: int, eos_token_ids: frozenset[int], kv: KVCacheManager,
                 lora: LoraManager | None, grammar_compile_timeout_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self.model_shape = model_shape
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.kv = kv
        self.lora = lora
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 lora: str | None = None) -> None:
        """Raise ValueError for a request that must never enter the scheduler."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_shape.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidField("prompt", f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids),
                          ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise InvalidField(name, f"{name} holds token ids out of range [0, {vocab}): "
                                         f"{outside[:5]}")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidField("max_tokens",
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"= {total} exceeds the model's context of {self.max_model_len} tokens")
        # The one "fits in the cache" check: the scheduler relies on it (Scheduler.add).
        room = self.kv.max_tokens_per_request(lora or BASE_POOL)
        if total > room:
            raise InvalidField("max_tokens",
                f"prompt + max_tokens = {total} tokens exceeds the whole KV cache "
                f"({self.kv.num_blocks * self.kv.block_size} tokens) or its pool's share "
                f"({room} tokens)")

    def takes_long(self, prompt: str | list[int], params: SamplingParams,
                   cache_salt: str | None = None) -> bool:
        """Whether make_request() may take long: text to tokenize, bad words to spell, or a
        grammar not compiled yet (a large one takes seconds). Else it only checks numbers."""
        if isinstance(prompt, str) or params.bad_words:
            return True
        if params.structured is None:
            return False
        # Read without _grammar_lock: it is held while the compiler is built, and this runs
        # on the event loop (one attribute read is atomic).
        grammars = self._grammars
        return grammars is None or not grammars.is_compiled(params.structured, cache_salt)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     priority: int = 0, arrival_time: float | None = None,
                     cache_salt: str | None = None, lora: str | None = None) -> Request:
        """Tokenize and validate; arrival_seq is left 0 for the engine to number."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            prompt_ids = self.tokenize(prompt)
        else:
            prompt_ids = list(prompt)
        if params.bad_words:  # both fields given: every sequence of either is banned
            spelled = self._bad_words_ids(params.bad_words)
            if any(len(word) > MAX_STOP_LENGTH for word in spelled):
                raise InvalidField("bad_words", f"a bad word spells into more than "
                                   f"{MAX_STOP_LENGTH} tokens")
            banned = tuple(dict.fromkeys((*params.bad_words_token_ids, *spelled)))
            if len(banned) > 2 * MAX_TOKEN_LISTS:
                raise InvalidField("bad_words", f"bad_words (two spellings each) and "
                                   f"bad_words_token_ids may ban at most "
                                   f"{2 * MAX_TOKEN_LISTS} token sequences together")
            params = replace(params, bad_words_token_ids=banned)
        self.validate(prompt_ids, params, lora)
        grammar = None if params.structured is None else \
            self._grammar_compiler().compile(params.structured, cache_salt)
        lora_identity = None
        if lora is not None:
            if self.lora is None:
                raise ValueError(f"adapter {lora!r} requested but LoRA is disabled "
                                 f"(max_loras=0)")
            lora_identity = self.lora.identity(lora)
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_seq=0,
            priority=priority,
            lora_name=lora,
            extra_keys=request_extra_keys(lora=lora_identity, cache_salt=cache_salt),
            timing=RequestTiming(arrival=arrival_time or time.monotonic()),
            grammar=grammar,
        )

    def with_current_adapter(self, request: Request) -> Request:
        """The request with its adapter's identity as it is now (engine thread, at
        admission): made on another thread, it may have read an adapter reloaded since with
        other weights, whose blocks must never be found under the old digest."""
        if request.lora_name is None or self.lora is None:
            return request
        current = ("lora", *self.lora.identity(request.lora_name))
        if request.extra_keys[:1] == (current,):
            return request
        others = tuple(key for key in request.extra_keys if key[0] != "lora")
        return replace(request, extra_keys=(current, *others))

    def close(self) -> None:
        """Stop the grammar compiler's helper process, if one runs."""
        with self._grammar_lock:
            if self._grammars is not None:
                self._grammars.close()

    def _grammar_compiler(self) -> GrammarCompiler:
        """Built on the first structured request (reading the vocabulary takes a moment);
        any thread may ask first."""
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model_shape.vocab_size,
                                                 self.eos_token_ids,
                                                 self.grammar_compile_timeout_s)
            return self._grammars

    def _bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word as the tokenizer spells it alone and after a space (as vLLM does: in a
        running text a word usually follows one)."""
        spellings: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    spellings[ids] = None
        return tuple(spellings)
