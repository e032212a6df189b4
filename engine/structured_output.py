"""Structured outputs: the generated text is held to a JSON schema, any JSON object, a
regular expression, one of fixed choices, or an EBNF grammar, by masking at every step the
tokens that cannot continue a valid text (xgrammar: grammars compiled against the
tokenizer's vocabulary once and cached, a matcher per request, token bitmasks applied to
the batch's logits).

The spec is validated and compiled when the request is made (an invalid schema is the
caller's error, before the request enters the engine); the matcher advances with each
sampled token and lives until the request finishes, so a request preempted and recomputed
keeps its place in the grammar. The grammar's end is an end-of-sequence token, which ends
the request as any other would.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.grammar_probe import GrammarProbe, compile_spec
from engine.invalid_field import InvalidField
from engine.json_schema_combinations import with_required_tags
from engine.json_schema_support import structural_tag_schemas, unenforced_keyword

log = logging.getLogger(__name__)
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
COMPILED_CACHE = 256
"""(cache scope, spec) pairs kept compiled (RAG and tool traffic repeats a handful of
schemas per tenant)."""


@dataclass(frozen=True)
class StructuredOutput:
    """What the generated text must match. ``kind``: "json" (``spec`` a JSON schema, as
    text), "json_object" (any JSON object), "regex" (``spec``), "choice" (exactly one of
    ``choices``), "grammar" (``spec`` in xgrammar's EBNF, GBNF-style) or "structural_tag"
    (``spec`` an xgrammar structural tag, as JSON text: free text in which each trigger
    starts a tagged section that must match its content, as strict tool calls are)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = field(default_factory=tuple)
    any_whitespace: bool = True
    """JSON kinds: whitespace between tokens as JSON allows; False: single-line JSON only,
    one space after each ':' and ',' (a small model can otherwise spend its whole budget on
    whitespace)."""
    param: str = field(default="structured_outputs", compare=False)
    """The request field it came from: what a spec that does not compile is refused as (no
    part of its identity: the same grammar from two fields is one)."""
    best_effort: bool = False
    """JSON kinds: hold what the grammar can, without refusing a schema keyword it would
    drop (a forced call of functions not all strict, whose arguments OpenAI too only tries
    to fit to their parameters). Part of its identity: a spec to be refused is never served
    from the cached compile of its best-effort twin."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if not isinstance(self.param, str) or not 0 < len(self.param) <= 64:
            raise ValueError("a structured output's param names a request field")
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got "
                             f"{self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"a structured output spec is a string of at most "
                             f"{MAX_SPEC_CHARS} characters")
        if self.kind in ("json", "regex", "grammar", "structural_tag") and not self.spec:
            raise ValueError(f"structured output {self.kind!r} needs its spec")
        if self.kind == "choice" and (
                not self.choices or len(self.choices) > MAX_CHOICES
                or any(not isinstance(c, str) or not c for c in self.choices)):
            raise ValueError(f"a choice needs 1 to {MAX_CHOICES} non-empty strings")
        if self.kind == "choice" and len(_choice_grammar(self.choices)) > MAX_SPEC_CHARS:
            # The grammar compiled is the spec: its cost grows faster than its size (about
            # 0.4 s at this bound on one core, 46 s at 360 KB), like any other spec's.
            raise ValueError(f"the choices, as a grammar, must take at most {MAX_SPEC_CHARS} "
                             f"characters")

    def to_json(self) -> dict[str, Any]:
        body = {"kind": self.kind, "spec": self.spec, "choices": list(self.choices),
                "any_whitespace": self.any_whitespace}
        if self.param != "structured_outputs":  # an engine from before it knew no param
            body["param"] = self.param
        if self.best_effort:
            body["best_effort"] = True
        return body


def _choice_grammar(choices: Iterable[str]) -> str:
    # JSON string literals are valid EBNF string literals in xgrammar (same escapes).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer (thread-safe: requests are made on
    other threads than the engine's). With ``compile_timeout_s`` > 0, a spec not compiled
    yet is refused when its compile takes longer (engine/grammar_probe.py).

    Compiled grammars are cached per ``scope`` (the request's cache salt: a tenant's own):
    a spec another tenant compiled is compiled again, so that no tenant can tell by the
    time of an answer which schemas another one uses."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 compile_timeout_s: float = 0.0) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        # Our LRU is the cache: xgrammar's own keeps every grammar ever compiled (no limit
        # by default), tens of KB each, which distinct schemas would grow without bound.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._probe = GrammarProbe(info.serialize_json(), compile_timeout_s) \
            if compile_timeout_s > 0 else None
        self._compiled: OrderedDict[tuple[str | None, StructuredOutput], Any] = OrderedDict()
        """LRU, newest last, keyed by (scope, spec)."""
        self._lock = threading.Lock()

    def is_compiled(self, spec: StructuredOutput, scope: str | None = None) -> bool:
        """Whether compile(spec, scope) would answer from the cache (at once)."""
        with self._lock:
            return (scope, spec) in self._compiled

    def compile(self, spec: StructuredOutput, scope: str | None = None) -> Any:
        """The compiled grammar, from the cache of the COMPILED_CACHE latest (scope, spec)
        pairs or compiled now (outside the lock: several threads may compile at once);
        ValueError naming what is wrong with the spec (not cached)."""
        key = (scope, spec)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return compiled

    def close(self) -> None:
        """Stop the compile-time helper process, if one runs."""
        if self._probe is not None:
            self._probe.close()

    def _compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar; ValueError naming what is wrong with the spec."""
        # json_object: an object, not any JSON value (OpenAI's meaning).
        text = {"json_object": '{"type": "object"}',
                "choice": _choice_grammar(spec.choices)}.get(spec.kind, spec.spec)
        try:
            if spec.kind in ("json", "structural_tag"):
                parsed = json.loads(text)  # a clear error for text that is not JSON at all
                tagged = with_required_tags(parsed)
                if tagged is not parsed:  # a discriminated union's tags, required (see there)
                    parsed, text = tagged, json.dumps(tagged)
                schemas = [parsed] if spec.kind == "json" else structural_tag_schemas(parsed)
                for schema in [] if spec.best_effort else schemas:
                    if (reason := unenforced_keyword(schema)) is not None:
                        raise InvalidField(spec.param, f"the JSON schema's {reason}; remove "
                                                       "it, or check the output yourself")
            if self._probe is not None and spec.kind != "json_object":  # a constant schema
                self._probe.check(spec.kind, text, spec.any_whitespace, spec.param)
            return compile_spec(self._compiler, spec.kind, text, spec.any_whitespace)
        except json.JSONDecodeError as exc:
            raise InvalidField(spec.param, f"the JSON schema is not valid JSON: {exc.msg}"
                               ) from None
        except InvalidField:
            raise
        except (RuntimeError, ValueError) as exc:  # xgrammar reports bad specs so
            message = str(exc)
            if isinstance(exc, UnicodeDecodeError) and isinstance(exc.object, bytes):
                # Its message quoted the spec with a character cut in two: read it anyway.
                message = exc.object.decode("utf-8", "replace")
            raise InvalidField(spec.param, f"invalid {spec.kind} for structured output: "
                               f"{library_reason(message)}") from None


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
"""xgrammar's messages start like its log lines: time, its source file and line, and for a
failed internal check the condition, none of which tells the caller anything."""


def library_reason(message: str) -> str:
    """The first line of xgrammar's message without its log prefix, at most 300 characters
    ("Regex parsing error at position 4: The parenthesis is not closed.")."""
    lines = message.strip().splitlines()
    reason = _LOG_PREFIX.sub("", lines[0]).strip() if lines else ""
    return reason[:300] or "invalid"
