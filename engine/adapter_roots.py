"""Where adapters registered through the engine API may come from.

``POST /adapters {"name", "path"}`` makes the engine read a directory; without a bound, a
caller could have it read (and report on the existence of) anything the engine's user can.
So such paths must resolve, symlinks followed, to a place inside one of the engine's adapter
roots: the ``--adapter-root`` directories plus the directories of the adapters given on the
engine's own command line (``--lora``, ``--adapter-dir``), which the operator vouched for.
An engine with no roots accepts no adapter through its API.

Refusals say nothing about the file system: a path outside the roots gets the same answer
whether it exists or not.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOTS_ENV = "LORAGATE_ADAPTER_ROOTS"
"""os.pathsep-separated roots, read when no --adapter-root flag is given."""


def roots_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """The roots in LORAGATE_ADAPTER_ROOTS (none when it is unset)."""
    value = (os.environ if environ is None else environ).get(ROOTS_ENV, "")
    return [part for part in value.split(os.pathsep) if part]


class AdapterPathRefused(ValueError):
    """A requested adapter path is outside the roots, or inside them but missing. Its
    message is safe to return to the caller (no path in it)."""


OUTSIDE = "adapter path is outside the engine's adapter roots"
MISSING = "adapter directory does not exist"


class AdapterRoots:
    """The resolved root directories; check() maps a requested path to its resolved form."""

    def __init__(self, roots: Iterable[str | Path]) -> None:
        # Resolved once, at startup: a root that does not exist yet (an upload directory
        # created on the first upload) is taken as its lexical absolute form. A later
        # symlink swap of a root makes what it points to fail the check, never pass it.
        self.roots: tuple[Path, ...] = tuple(dict.fromkeys(
            Path(root).expanduser().resolve() for root in roots if str(root)))

    def __contains__(self, path: Path) -> bool:
        return any(path == root or path.is_relative_to(root) for root in self.roots)

    def check(self, path: str) -> Path:
        """The requested path resolved (symlinks followed) if it lies inside a root;
        AdapterPathRefused otherwise. Missing paths inside a root are refused as missing,
        missing paths outside as outside: no existence oracle beyond the roots."""
        try:
            resolved = Path(path).resolve(strict=True)
        except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, a NUL byte
            try:
                lexical = Path(path).resolve(strict=False)
            except (OSError, RuntimeError, ValueError):
                raise AdapterPathRefused(OUTSIDE) from None
            raise AdapterPathRefused(MISSING if lexical in self else OUTSIDE) from None
        if resolved not in self:
            raise AdapterPathRefused(OUTSIDE)
        return resolved
