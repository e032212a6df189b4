"""Per-module rank and alpha of a PEFT LoRA config (``rank_pattern``, ``alpha_pattern``), read
as PEFT reads them when it builds the model (``get_pattern_key``): the first key, in the
config's order, that matches the end of a module's full name after a dot, or the whole name,
as a regular expression (``(.*\\.)?(KEY)$``), gives that module's rank or alpha; a module no
key matches takes ``r`` and ``lora_alpha``.

Names are the base model's module names, e.g. ``model.layers.3.self_attn.q_proj``. The keys
come from the adapter's uploader: like target_modules' patterns (lora/peft_targets.py), all
their matches for one adapter run under one time limit, so a slow pattern is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import regex

from lora.peft_regex import compile_pattern, deadline, timed_match

MAX_PATTERN_KEYS = 4096
"""A pattern per module of a large model is a few thousand; more is not a PEFT config."""
MAX_KEY_CHARS = 1 << 16
"""All of one pattern's keys together: a full module name per module of a large model is
tens of kilobytes; a megabyte of long expressions takes seconds to compile."""


@dataclass(frozen=True)
class ModuleShape:
    """A module's LoRA rank and alpha, after the config's patterns."""

    rank: int
    alpha: float


def module_shapes(config: dict[str, Any], where: str, rank: int, alpha: float
                  ) -> Callable[[str], ModuleShape]:
    """A function from a module's full name to its rank and alpha under ``config``
    (adapter_config.json), whose own ``r`` and ``lora_alpha`` are ``rank`` and ``alpha``.
    ValueError naming ``where`` for a pattern PEFT would not take (a key that is not a
    regular expression, a rank that is not a positive integer, an alpha that is not a finite
    number) or a key whose matching takes too long."""
    ranks = _patterns(config.get("rank_pattern"), "rank_pattern", where, _positive_int,
                      "a positive integer")
    alphas = _patterns(config.get("alpha_pattern"), "alpha_pattern", where, _finite_number,
                       "a finite number")
    until = deadline()

    def shape(name: str) -> ModuleShape:
        return ModuleShape(int(_first_match(ranks, name, where, until, rank)),
                           float(_first_match(alphas, name, where, until, alpha)))

    return shape


_Patterns = list[tuple[str, "regex.Pattern[str]", float]]


def _patterns(value: Any, key: str, where: str, check: Callable[[Any], bool], wanted: str
              ) -> _Patterns:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {key} must be an object of module patterns, got "
                         f"{str(value)[:100]}")
    if len(value) > MAX_PATTERN_KEYS:
        raise ValueError(f"{where}: {key} has {len(value)} keys, over {MAX_PATTERN_KEYS}")
    if (chars := sum(len(pattern) for pattern in value)) > MAX_KEY_CHARS:
        raise ValueError(f"{where}: {key}'s keys hold {chars} characters, over "
                         f"{MAX_KEY_CHARS}")
    compiled: _Patterns = []
    for pattern, number in value.items():
        if not check(number):
            raise ValueError(f"{where}: {key}[{pattern[:100]!r}] must be {wanted}, got "
                             f"{repr(number)[:100]}")
        compiled.append((pattern, compile_pattern(pattern, rf"(.*\.)?({pattern})$",
                                                  f"{key} key", where), float(number)))
    return compiled


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _first_match(patterns: _Patterns, name: str, where: str, until: float,
                 default: float) -> float:
    for pattern, compiled, number in patterns:
        if timed_match(compiled, name, where, until, shown=pattern):
            return number
    return default
