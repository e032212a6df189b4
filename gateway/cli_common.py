"""What every `loragate` subcommand module shares: where loragate keeps its files, and how
path flags are read."""

from __future__ import annotations

import os
from pathlib import Path

DEMO_HOME = Path(os.environ.get("LORAGATE_HOME", Path.home() / ".cache" / "loragate"))
"""$LORAGATE_HOME: the default model, its adapters, downloads, logs and the gateway's state."""


def local_path(text: str) -> str:
    """A path flag made absolute once, as it is parsed: engines started from it, the
    gateway's tokenizer and the adapters registered under it all name the same directory,
    whatever their working directory (and `--model .` names the model, not ".")."""
    return str(Path(text).expanduser().resolve())
