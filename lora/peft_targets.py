"""Which modules a PEFT LoRA config targets, decided as PEFT decides it when it builds the
model (``check_target_module_exists``): ``target_modules`` as a list of names (a module's
full name, or its end after a dot), as a regular expression the full name must match, or
"all-linear"; ``layers_to_transform`` (with ``layers_pattern``) for a list; and
``exclude_modules``. A config without ``target_modules`` targets PEFT's defaults for the
model type.

PEFT loads only the weights of the modules it targets and ignores the others, so an adapter
whose file holds weights its config does not target would run differently here than under
PEFT: such an adapter is refused (lora/adapter.py), not served with weights PEFT never uses.

Names are the base model's module names, e.g. ``model.layers.3.self_attn.q_proj``. A
regular expression comes from the adapter's uploader: it is checked and compiled as
lora/peft_regex.py says, and its matches run under one time limit for the whole adapter (the
``regex`` package's timeouts), so a slow pattern is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import regex

from lora.peft_regex import compile_pattern, deadline, time_left, timed_match
from lora.targets import SUPPORTED_MODULES

PEFT_DEFAULT_TARGETS = {model_type: ("q_proj", "v_proj") for model_type in (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")}
"""What PEFT targets when target_modules is null (its
TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, for the model types the engine serves;
a test holds them to peft's). Kept here because importing peft takes seconds."""

_LAYER_ANY = regex.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")
"""PEFT's reading of a module's layer index without a layers_pattern: the first number
between dots after some segment."""


def module_targeter(config: dict[str, Any], where: str, model_type: str
                    ) -> Callable[[str], bool]:
    """A predicate on module names: does ``config`` (adapter_config.json), applied to a
    model of ``model_type``, target it? ValueError naming ``where`` for a config PEFT would
    not take (wrong types, a bad or slow regular expression, no targets it can default)."""
    targets = config.get("target_modules")
    # LoraConfig's own rules, so that a config PEFT refuses is refused here too.
    if isinstance(targets, str) and (config.get("layers_to_transform") is not None or
                                     config.get("layers_pattern") is not None):
        raise ValueError(f"{where}: layers_to_transform and layers_pattern cannot be used "
                         f"when target_modules is a string (a pattern, or all-linear)")
    if config.get("layers_pattern") and config.get("layers_to_transform") is None:
        raise ValueError(f"{where}: layers_pattern needs layers_to_transform")
    if targets is None:
        # PEFT then targets the model type's defaults, and ignores weights of other modules.
        if model_type not in PEFT_DEFAULT_TARGETS:
            raise ValueError(f"{where}: adapter_config.json names no target_modules, and "
                             f"PEFT has no default targets for model type {model_type!r}")
        targets = list(PEFT_DEFAULT_TARGETS[model_type])
    excluded = _names_or_pattern(config.get("exclude_modules"), "exclude_modules", where)
    if targets == "all-linear":
        targets = list(SUPPORTED_MODULES)
    chosen = _names_or_pattern(targets, "target_modules", where)
    layers = _layer_indexes(config.get("layers_to_transform"), where)
    patterns = _layer_patterns(config.get("layers_pattern"), where)

    until = deadline()

    def targeted(name: str) -> bool:
        if excluded is not None and _matches(excluded, name, where, until):
            return False
        if chosen is None or not _matches(chosen, name, where, until):
            return False
        # PEFT applies layers_to_transform only to names matched by their end, not to a
        # module listed by its full name (a pattern never comes with layers: see above).
        if isinstance(chosen, regex.Pattern) or layers is None or name in chosen:
            return True
        index = _layer_of(name, patterns, until)
        return index is not None and index in layers

    return targeted


_NamesOrPattern: TypeAlias = "frozenset[str] | regex.Pattern[str]"


def _names_or_pattern(value: Any, key: str, where: str) -> _NamesOrPattern | None:
    if value is None or value == [] or value == "":
        return None
    if isinstance(value, str):
        return compile_pattern(value, value, key, where)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return frozenset(value)
    raise ValueError(f"{where}: {key} must be a list of module names or a regular "
                     f"expression, got {str(value)[:100]}")


def _matches(chosen: _NamesOrPattern, name: str, where: str, until: float) -> bool:
    if isinstance(chosen, frozenset):
        return name in chosen or any(name.endswith("." + target) for target in chosen)
    return timed_match(chosen, name, where, until, whole=True)


def _layer_indexes(value: Any, where: str) -> frozenset[int] | None:
    def is_index(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if value is None or value == []:
        return None
    if is_index(value):
        return frozenset([value])
    if isinstance(value, list) and all(is_index(v) for v in value):
        return frozenset(value)
    raise ValueError(f"{where}: layers_to_transform must be a layer index or a list of them, "
                     f"got {str(value)[:100]}")


def _layer_patterns(value: Any, where: str) -> list[regex.Pattern[str]]:
    """PEFT's layer-index expressions for the layers_pattern names (none: any segment)."""
    if value is None or value == "" or value == []:
        return [_LAYER_ANY]
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{where}: layers_pattern must be a name or a list of names, got "
                         f"{str(value)[:100]}")
    # PEFT puts the name into its expression unescaped: so does this, checked as any
    # pattern of the config is, and under the time limit.
    return [compile_pattern(name, rf"(?:^|.*?\.){name}\.(?P<idx>\d+)\.", "layers_pattern",
                            where) for name in names]


def _layer_of(name: str, patterns: list[regex.Pattern[str]], until: float) -> int | None:
    for pattern in patterns:
        try:
            found = pattern.match(name, timeout=time_left(until))
        except TimeoutError:
            return None
        if found is not None:
            return int(found["idx"])
    return None
