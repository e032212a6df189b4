"""The default model's demo style adapters (shout, json, brief): trained once, in the
background, while the server already serves the base model.

`loragate serve` without --model starts `python -m gateway.demo_adapters MODEL` when some of
them are missing from MODEL/adapters. That process trains each missing style in turn
(lora/demo_training.py, a few minutes each on 2 cores, at a lower CPU priority than serving)
into a hidden temporary directory and renames it into place when complete, so a directory
named after a style is always a whole adapter. The gateway watches the directory and
registers each adapter (public) as it appears; an interrupted run resumes at the next start.
Each adapter records the recipe it was trained with (RECIPE_FILE); one trained by another
version of the recipe is removed at start and trained again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from engine.parent_watch import child_env, exit_with_parent
from gateway.auth import StateView
from gateway.tenancy import AdapterRecord
from lora.demo_data import STYLES

log = logging.getLogger(__name__)
WATCH_EVERY_S = 5.0
TRAIN_ENV = "LORAGATE_DEMO_ADAPTERS"
"""Set to 0 to serve the default model without training its demo adapters."""
TRAINING_LOCK = ".training.lock"
"""Held (flock) by the process training into an adapter directory."""
RECIPE_FILE = "loragate-demo.json"
"""Written into each demo adapter's directory: the recipe that trained it (recipe())."""


def recipe(style: str) -> dict[str, object]:
    """What a demo adapter of ``style`` is trained from: its config and a digest of the code
    that makes its data and trains it (any change there makes a different adapter)."""
    import lora.demo_data
    import lora.demo_training

    code = hashlib.sha256()
    for module in (lora.demo_data, lora.demo_training):
        code.update(Path(str(module.__file__)).read_bytes())
    config = asdict(lora.demo_training.DemoTrainingConfig.for_style(style))
    return {"style": style, "config": config, "code_sha256": code.hexdigest()}


def stale_styles(adapter_dir: Path) -> dict[str, str]:
    """style -> path of the demo adapters trained by another recipe than today's."""
    stale = {}
    for style, path in complete_adapters(adapter_dir).items():
        if style not in STYLES:
            continue
        try:
            recorded = json.loads((Path(path) / RECIPE_FILE).read_text())
        except (OSError, ValueError):
            recorded = None
        if recorded != json.loads(json.dumps(recipe(style))):  # tuples read back as lists
            stale[style] = path
    return stale


def remove_stale(adapter_dir: Path) -> list[str]:
    """Delete the demo adapters trained by another recipe than today's; returns their styles
    (under the training lock: see train_missing)."""
    stale = stale_styles(adapter_dir)
    for style, path in stale.items():
        # Renamed first so that no whole-looking directory is ever half deleted.
        doomed = Path(tempfile.mkdtemp(prefix=f".{style}.stale-", dir=adapter_dir))
        Path(path).rename(doomed / style)
        shutil.rmtree(doomed, ignore_errors=True)
    return list(stale)


def complete_adapters(adapter_dir: Path) -> dict[str, str]:
    """name -> path of the whole PEFT directories in adapter_dir (hidden ones are partial)."""
    if not adapter_dir.is_dir():
        return {}
    return {child.name: str(child.resolve()) for child in sorted(adapter_dir.iterdir())
            if not child.name.startswith(".")
            and (child / "adapter_config.json").is_file()
            and (child / "adapter_model.safetensors").is_file()}


def missing_styles(adapter_dir: Path) -> list[str]:
    have = complete_adapters(adapter_dir)
    return [style for style in STYLES if style not in have]


def start_training(model_dir: Path, log_path: Path) -> subprocess.Popen[bytes] | None:
    """Train the missing demo adapters in a background process (None: none is missing, or
    LORAGATE_DEMO_ADAPTERS=0 turned the training off)."""
    adapter_dir = model_dir / "adapters"
    adapter_dir.mkdir(exist_ok=True)
    if os.environ.get(TRAIN_ENV, "1") == "0":
        if missing := missing_styles(adapter_dir):
            print(f"demo adapters {', '.join(missing)} are not trained ({TRAIN_ENV}=0): the "
                  f"examples that use them need them", flush=True)
        return None
    with open(adapter_dir / TRAINING_LOCK, "a") as lock:
        try:  # removed before the gateway registers what is there ...
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            stale = remove_stale(adapter_dir)
        except BlockingIOError:  # ... unless a trainer is at work: it removes them itself
            stale = []
    if stale:
        print(f"demo adapters {', '.join(stale)} were trained by an older recipe: training "
              f"them again", flush=True)
    missing = missing_styles(adapter_dir)
    if not missing:
        return None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "gateway.demo_adapters",
                                    str(model_dir)], stdout=out, stderr=subprocess.STDOUT,
                                   env=child_env(os.environ))
    print(f"training the demo adapters {', '.join(missing)} in the background (a few minutes "
          f"each; the base model is served meanwhile; log in {log_path})", flush=True)
    return process


async def watch(adapter_dir: Path, view: StateView, interval_s: float = WATCH_EVERY_S) -> None:
    """Register each demo adapter as it appears (public); returns once all are there."""
    while True:
        new = {name: path for name, path in complete_adapters(adapter_dir).items()
               if name not in view.snapshot.adapters}
        for name, path in new.items():
            # Unless an admin registered the name meanwhile (theirs stands).
            if await view.store.swap_adapter(name, None, AdapterRecord(name, path)):
                log.info("demo adapter %s is ready and registered", name)
        if new:
            await view.refresh()
        if not missing_styles(adapter_dir):
            return
        await asyncio.sleep(interval_s)


def train_missing(model_dir: Path, adapter_dir: Path | None = None) -> None:
    """Train every missing style into adapter_dir (default model_dir/adapters), one after
    another (and first remove those of an older recipe); the base model answers the training
    questions once for all of them. One trainer at a time per directory (a `loragate serve`
    training in the background and a test suite may share it): a second waits, then trains
    only what is still missing."""
    from lora.demo_training import DemoTrainingConfig, train_demo_adapter

    adapter_dir = model_dir / "adapters" if adapter_dir is None else adapter_dir
    adapter_dir.mkdir(parents=True, exist_ok=True)
    with open(adapter_dir / TRAINING_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when this process ends, however
        remove_stale(adapter_dir)
        for stale in [*adapter_dir.glob(".*.partial-*"), *adapter_dir.glob(".*.stale-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by an interrupted run
        answers: dict[str, str] = {}
        for style in missing_styles(adapter_dir):
            partial = Path(tempfile.mkdtemp(prefix=f".{style}.partial-", dir=adapter_dir))
            try:
                report = train_demo_adapter(model_dir, partial,
                                            DemoTrainingConfig.for_style(style),
                                            log=functools.partial(_log, style),
                                            known_answers=answers)
                answers = report.base_answers
                (partial / RECIPE_FILE).write_text(json.dumps(recipe(style), indent=2))
                partial.rename(adapter_dir / style)
            finally:
                if partial.exists():
                    shutil.rmtree(partial, ignore_errors=True)


def _log(style: str, line: str) -> None:
    print(f"[{style}] {line}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m gateway.demo_adapters MODEL_DIR", file=sys.stderr)
        return 2
    with contextlib.suppress(OSError):
        os.nice(10)  # serving comes first on a small machine
    exit_with_parent()  # an interrupted run resumes at the next start
    train_missing(Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
