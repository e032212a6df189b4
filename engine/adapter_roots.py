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

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)
ROOTS_ENV = "LORAGATE_ADAPTER_ROOTS"
"""os.pathsep-separated roots, read when no --adapter-root flag is given."""


def roots_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """The roots in LORAGATE_ADAPTER_ROOTS (none when it is unset)."""
    value = (os.environ if environ is None else environ).get(ROOTS_ENV, "")
    return [part for part in value.split(os.pathsep) if part]


class AdapterPathRefused(ValueError):
    """A requested adapter path is outside the roots, or inside them but missing. Its
    message is safe to return to the caller (no path in it)."""


OUTSIDE = ("adapter path is outside the engine's adapter roots (give its directory's parent "
           "with --adapter-root)")
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


def parse_adapters(specs: Sequence[str], adapter_dir: str | None,
                   local: bool = True) -> dict[str, str]:
    """--lora NAME=PATH (repeatable) and --adapter-dir DIR (each PEFT directory inside is an
    adapter named after it) -> name -> absolute path. Under DIR, a link that leads outside
    it (the directory or one of its PEFT files) is skipped with a warning: whoever can write
    into DIR must not make the server read files elsewhere. ``local``: the paths are on this
    host, so a --lora path without an adapter_config.json is refused now, before a model
    loads (paths for remote engines are theirs to check)."""
    adapters: dict[str, str] = {}
    if adapter_dir:
        root = Path(adapter_dir)
        if not root.is_dir():
            raise ValueError(f"--adapter-dir {adapter_dir!r} is not a directory")
        real_root = root.resolve()
        for child in sorted(root.iterdir()):
            # Hidden directories are partial (an adapter still being written or unpacked).
            if child.name.startswith(".") or not (child / "adapter_config.json").is_file():
                continue
            real = child.resolve()
            files = (real, real / "adapter_config.json", real / "adapter_model.safetensors")
            if not all(f.resolve().is_relative_to(real_root) for f in files):
                log.warning("--adapter-dir: skipping %s: it links outside %s", child, real_root)
                continue
            adapters[child.name] = str(real)
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora expects NAME=PATH, got {spec!r}")
        if local and not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"--lora {spec}: not a PEFT adapter directory (no "
                             f"adapter_config.json there)")
        adapters[name] = str(Path(path).resolve())
    return adapters


def check_served_adapters(specs: Sequence[str], adapters: dict[str, str], model: str,
                          max_rank: int, base_name: str, load: bool) -> dict[str, str]:
    """The adapters `serve` or `loragate engine` registers. A --lora name given twice, and
    an adapter named as the base model, stop the start, as vLLM refuses such
    --lora-modules: listed, each would never reach (or silently replace) what was asked
    for. With ``load`` (the engines are on this host), each is loaded once against the
    model first: one named by --lora that does not load stops the start too, and one found
    in the adapter directory is left out with a warning, so the others are served."""
    from engine.models.loader import load_hf_config
    from engine.models.shape import ModelShape
    from lora.adapter import load_adapter

    named = [spec.partition("=")[0] for spec in specs]
    if twice := sorted({name for name in named if named.count(name) > 1}):
        raise ValueError(f"--lora {twice[0]} is given more than once")
    if base_name in adapters:
        raise ValueError(f"adapter name {base_name!r} is the base model's name")
    if not load:
        return adapters
    targets = ModelShape.from_hf_config(load_hf_config(model)).lora_targets()
    served: dict[str, str] = {}
    for name, path in adapters.items():
        try:
            load_adapter(name, path, targets, max_rank)
        except ValueError as exc:
            if name in named:
                raise ValueError(f"--lora {name}={path}: {exc}") from None
            log.warning("not serving the adapter directory's %s: %s", name, exc)
            continue
        served[name] = path
    return served
