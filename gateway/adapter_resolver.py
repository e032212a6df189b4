"""Adapters resolved on first use (vLLM's LoRA resolver plugins, for a directory of
adapters): a request whose ``model`` names nothing the gateway knows is looked up as
``<root>/<name>`` in the configured roots; a PEFT directory there is validated against the
base model and the engines' rank limit, then registered as a public adapter, exactly as
``POST /v1/load_lora_adapter`` would, and the request goes on with it.

Only names the admin API would accept are looked up (no path separators, no ``..``), the
directory must resolve (symlinks followed) inside its root, and a name already taken, by an
adapter the caller may not see included, stays a 404: the resolver never tells a caller
more than a plain unknown model would. Requests racing for one new name load it once.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

from engine.http.errors import ApiError
from engine.models.shape import ModelShape
from gateway import adapter_admin as lifecycle
from gateway.admin_api import record_adapter, validate_adapter
from gateway.admin_common import NAME_PATTERN
from gateway.service import Gateway
from gateway.tenancy import AdapterRecord

log = logging.getLogger(__name__)
CONFIG_FILE = "adapter_config.json"


class AdapterResolver:
    """Looks up unknown model names in ``roots`` and registers what it finds."""

    def __init__(self, roots: list[str], shape: ModelShape) -> None:
        self.roots = [Path(root).resolve() for root in roots]
        self.shape = shape
        self._loading: dict[str, asyncio.Lock] = {}
        """One lock per name found in the roots (bounded by their directories)."""

    def candidate(self, name: str) -> Path | None:
        """The PEFT directory a name resolves to, if any root holds one."""
        if re.fullmatch(NAME_PATTERN, name) is None or name in (".", ".."):
            return None
        for root in self.roots:
            path = (root / name).resolve()
            if path.parent == root and (path / CONFIG_FILE).is_file():
                return path
        return None

    async def __call__(self, gateway: Gateway, name: str) -> bool:
        """Register ``name`` from the roots; False when there is nothing (valid) to load."""
        path = self.candidate(name)
        if path is None:
            return False
        lock = self._loading.setdefault(name, asyncio.Lock())
        async with lock:
            if name in gateway.view.snapshot.adapters:  # taken, or loaded while we waited
                return True
            try:
                adapter = await validate_adapter(name, str(path), self.shape,
                                                 lifecycle.max_rank(gateway))
                await record_adapter(gateway, AdapterRecord(name, str(path),
                                                            digest=adapter.digest))
            except ApiError as exc:  # an invalid directory, or the name taken meanwhile
                log.warning("adapter resolver: %s in %s not registered: %s", name,
                            path.parent, exc.message)
                return False
        log.info("adapter resolver: registered %s from %s", name, path)
        return True
