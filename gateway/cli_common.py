"""What every `loragate` subcommand module shares: where loragate keeps its files, and how
path flags are read (engine/config_args.py local_path)."""

from __future__ import annotations

import os
from pathlib import Path

from engine.config_args import local_path

__all__ = ["DEMO_HOME", "local_path"]

DEMO_HOME = Path(os.environ.get("LORAGATE_HOME", Path.home() / ".cache" / "loragate"))
"""$LORAGATE_HOME: the default model, its adapters, downloads, logs and the gateway's state."""

