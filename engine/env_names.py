"""The LORAGATE_* environment variables that loragate reads, and a warning for the others.

Every config field is also ``LORAGATE_<FIELD>`` (engine/config_args.py); the names below are
read besides those, by the servers, their children and the project's own tools and docs. A
``LORAGATE_*`` variable that is neither has no effect, so `loragate serve` and `loragate
engine` say so at start (a misspelt setting would otherwise change nothing without a word),
naming the closest known name, as vLLM warns about VLLM_* variables it does not know.
tests/test_env_names.py keeps this list complete: every such name the repository mentions
must be one of them or a field's.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Iterable, Mapping

from engine.config_args import ENV_PREFIX

OTHER_NAMES = frozenset({
    # servers and their children
    "LORAGATE_HOME", "LORAGATE_ENGINE_TOKEN", "LORAGATE_REGISTER_REDIS_URL",
    "LORAGATE_ADVERTISE_URL", "LORAGATE_ADAPTER_ROOTS", "LORAGATE_PARENT_PID",
    "LORAGATE_STATE_PATH", "LORAGATE_DEMO_ADAPTERS", "LORAGATE_CPU_MARCH",
    "LORAGATE_LORA_BACKEND",
    # clients, examples, benchmarks, tests, dev.sh and the deploy manifests
    "LORAGATE_BASE_URL", "LORAGATE_MODEL", "LORAGATE_API_KEY", "LORAGATE_PEER_VENV",
    "LORAGATE_LM_EVAL_VENV", "LORAGATE_CONSTRAINTS", "LORAGATE_IMAGE", "LORAGATE_REAL_MODEL",
    "LORAGATE_FUZZ_EXAMPLES", "LORAGATE_TEST_WORKERS",
})
"""LORAGATE_* names read other than as a config field."""

log = logging.getLogger(__name__)


def field_names(*config_classes: type) -> set[str]:
    """LORAGATE_<FIELD> of every field of the given config dataclasses."""
    return {ENV_PREFIX + f.name.upper() for cls in config_classes
            for f in dataclasses.fields(cls)}


def unknown_names(known: Iterable[str], environ: Mapping[str, str] | None = None
                  ) -> list[tuple[str, str | None]]:
    """(name, the closest known name or None) for each LORAGATE_* variable set in
    ``environ`` (default os.environ) that is neither in ``known`` nor in OTHER_NAMES."""
    environ = os.environ if environ is None else environ
    every = {*known, *OTHER_NAMES}
    # Compared without the prefix every name shares, which would make all of them close.
    suffixes = sorted(name.removeprefix(ENV_PREFIX) for name in every)
    return [(name, next((ENV_PREFIX + s for s in difflib.get_close_matches(
                name.removeprefix(ENV_PREFIX), suffixes, n=1, cutoff=0.75)), None))
            for name in sorted(environ) if name.startswith(ENV_PREFIX) and name not in every]


def warn_unknown(command: str, *config_classes: type) -> None:
    """Log a warning for each LORAGATE_* variable that ``command`` (with these configs)
    does not read."""
    for name, closest in unknown_names(field_names(*config_classes)):
        hint = f" (did you mean {closest}?)" if closest else ""
        log.warning("ignoring the environment variable %s: %s reads no such setting%s",
                    name, command, hint)
