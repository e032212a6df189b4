"""Regular expressions from an adapter's config (target_modules, exclude_modules,
rank_pattern and alpha_pattern keys), read as PEFT reads them, and safe to compile.

PEFT matches them with Python's ``re``; they come from the adapter's uploader. Each is:

- parsed by ``re`` first: what ``re`` refuses, PEFT cannot use, and what it reads in a way
  the ``regex`` package reads otherwise (a set inside a set, ``[[:digit:]]``, which ``re``
  takes as characters and warns about) is refused rather than served differently;
- refused when its counted repetitions multiply past MAX_REPEAT_PRODUCT along any nesting
  (``(?:(?:x{100}){100}){100}``): a compiler that unrolls them takes gigabytes for a pattern
  of 30 characters, and no module name is that long;
- compiled with ``regex`` without its pattern cache (a refused pattern must not stay in
  memory), whose matches take a timeout: ``re`` would backtrack catastrophically without a
  bound. All the matches of one adapter's patterns share one deadline (``deadline()``), so
  a slow pattern is refused.
"""

from __future__ import annotations

import re
import re._parser as re_parser
import time
import warnings
from typing import Any

import regex

MAX_PATTERN_CHARS = 4096
PATTERN_TIMEOUT_S = 0.5
"""All the matches of one adapter's patterns together (a few hundred module names of tens of
characters): far more than any sane pattern needs."""
MAX_REPEAT_PRODUCT = 1024
"""Far past any module name's length (under 100 characters)."""

_REPEATS = {re_parser.MAX_REPEAT, re_parser.MIN_REPEAT, re_parser.POSSESSIVE_REPEAT}


def compile_pattern(pattern: str, compiled_as: str, what: str, where: str
                    ) -> regex.Pattern[str]:
    """``compiled_as`` (``pattern`` itself, or PEFT's wrapping of it) compiled, once
    ``pattern`` passed the checks above; ValueError naming ``where`` and ``what`` (the
    config key) otherwise."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"{where}: {what} is a pattern of {len(pattern)} characters, over "
                         f"{MAX_PATTERN_CHARS}")
    shown = repr(pattern[:100])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            parsed = re_parser.parse(compiled_as)
        except (re.error, FutureWarning, DeprecationWarning, RecursionError,
                OverflowError) as exc:
            raise ValueError(f"{where}: {what} {shown} is not a regular expression Python's "
                             f"re (PEFT's) reads as written: {exc}") from None
    if _repeat_product(parsed.data) > MAX_REPEAT_PRODUCT:
        raise ValueError(f"{where}: {what} {shown} repeats a part more than "
                         f"{MAX_REPEAT_PRODUCT} times (counted repetitions multiplied)")
    try:
        return regex.compile(compiled_as, cache_pattern=False)
    except regex.error as exc:
        raise ValueError(f"{where}: {what} {shown} is not a regular expression: {exc}"
                         ) from None


def deadline() -> float:
    """When one adapter's matches must be done (time.monotonic())."""
    return time.monotonic() + PATTERN_TIMEOUT_S


def time_left(until: float) -> float:
    """Seconds left before ``until`` (a timeout of 0 would mean none: at least 1 ms)."""
    return max(until - time.monotonic(), 0.001)


def timed_match(compiled: regex.Pattern[str], name: str, where: str, until: float,
                whole: bool = False, shown: str | None = None) -> bool:
    """Whether ``compiled`` matches ``name`` from its start (``whole``: all of it) before
    ``until``; ValueError naming ``where`` and the pattern (``shown``: as the config gave
    it) once the time is up."""
    match = compiled.fullmatch if whole else compiled.match
    try:
        return match(name, timeout=time_left(until)) is not None
    except TimeoutError:
        pattern = compiled.pattern if shown is None else shown
        raise ValueError(f"{where}: matching the pattern {pattern[:100]!r} against the "
                         f"module names took over {PATTERN_TIMEOUT_S:g} s") from None


def _repeat_product(items: Any) -> int:
    """The largest product of counted repetitions along any nesting of a parsed pattern
    (an unbounded repetition counts its minimum)."""
    most = 1
    for op, av in items:
        if op in _REPEATS:
            low, high, sub = av
            count = low if high == re_parser.MAXREPEAT else high
            most = max(most, max(1, count) * _repeat_product(sub))
        else:
            for part in _parts(op, av):
                most = max(most, _repeat_product(part))
    return most


def _parts(op: Any, av: Any) -> list[Any]:
    """The sub-patterns of one parsed item (groups, branches, assertions, conditionals)."""
    if op is re_parser.SUBPATTERN:
        return [av[3]]
    if op is re_parser.BRANCH:
        return list(av[1])
    if op in (re_parser.ASSERT, re_parser.ASSERT_NOT):
        return [av[1]]
    if op is re_parser.ATOMIC_GROUP:
        return [av]
    if op is re_parser.GROUPREF_EXISTS:
        return [part for part in av[1:] if part is not None]
    return []
