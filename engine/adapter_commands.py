"""AdapterCommands: load, unload and pin adapters on a running engine (AsyncEngine's).

Each command's change runs on the engine thread between steps (through ``call``), so the
scheduler never sees an adapter half registered. A PEFT directory is validated off that
thread first (reading and checking weights takes a while). Invariant: no request runs on
weights other than the ones its caller meant; replacing an adapter's content is refused
while any request (running, queued or preempted) uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from engine.adapter_roots import AdapterPathRefused, AdapterRoots
from engine.llm_engine import LLMEngine
from engine.protocol import EngineRejected, LoadedAdapter
from lora.adapter_info import AdapterInfo

OnEngineThread = Callable[[Callable[[], Any]], Awaitable[Any]]
"""Runs a function on the engine thread between steps and returns its result."""


class AdapterChanged(ValueError):
    """A request's adapter does not hold the weights its caller meant (GenerateRequest.
    adapter_digest): refused, never run on others."""


def changed_message(name: str) -> str:
    return f"adapter {name!r} does not hold the weights asked for on this engine"


class AdapterCommands:
    """The adapter commands of one engine; ``last`` is the adapter list as of the last
    command that read it (metrics scrapes read it without a round trip to the engine
    thread)."""

    def __init__(self, engine: LLMEngine, call: OnEngineThread) -> None:
        self.engine = engine
        self._call = call
        self.last: list[AdapterInfo] = engine.list_loras()

    async def load(self, name: str, path: str, roots: AdapterRoots | None) -> LoadedAdapter:
        """Validate a PEFT directory off the engine thread (inside ``roots``; None: any
        path), then register it: an adapter of the same name and other content replaces the
        registered one only when no request uses it (EngineRejected, 409)."""
        resolved = path
        if roots is not None:
            try:
                resolved = str(roots.check(path))
            except AdapterPathRefused as exc:
                raise EngineRejected(str(exc), None, 400, param="path") from None
        try:
            adapter = await asyncio.to_thread(self.engine.validate_lora, name, resolved)
        except ValueError as exc:
            # Validation messages name the directory: the caller learns what is wrong with
            # the adapter, not where the engine's files are.
            raise EngineRejected(_without_paths(str(exc), path, resolved), None, 400,
                                 param="path") from None
        except OSError:
            raise EngineRejected("the adapter's files could not be read", None, 400,
                                 param="path") from None

        def add() -> None:
            held = {a.name: a.digest for a in self.engine.list_loras()}
            if held.get(adapter.name, adapter.digest) != adapter.digest:
                self.engine.remove_lora(adapter.name)  # ValueError while a request uses it
            self.engine.add_lora(adapter)
            self.listed()

        try:
            await self._call(add)
        except ValueError as exc:
            raise EngineRejected(str(exc), "adapter_in_use") from None
        return LoadedAdapter(adapter.name, adapter.digest, adapter.rank)

    async def unload(self, name: str, digest: str | None = None) -> None:
        """Unregister an adapter: 404 if unknown (or, with ``digest``, holding other
        weights: those stay), 409 while any request uses it."""
        def remove() -> None:
            self._known(name)
            if digest is not None and self.digest_of(name) != digest:
                raise EngineRejected(f"adapter {name!r} holds other weights", None, 404)
            try:
                self.engine.remove_lora(name)
            except ValueError as exc:
                raise EngineRejected(str(exc), None, 409) from None
            self.listed()
        await self._call(remove)

    async def pin(self, name: str, pinned: bool) -> None:
        """Keep an adapter in its device slot (or let it go again)."""
        def pin() -> None:
            self._known(name)
            try:
                self.engine.pin_lora(name, pinned)
            except ValueError as exc:
                raise EngineRejected(str(exc), None, 404) from None
        await self._call(pin)

    # ---------------------------------------------------------------- engine thread
    def listed(self) -> list[AdapterInfo]:
        """The registered adapters, now (engine thread); also refreshes ``last``."""
        self.last = self.engine.list_loras()
        return self.last

    def digest_of(self, name: str) -> str | None:
        """The digest of the weights registered under ``name`` (None: none are; any
        thread)."""
        if self.engine.lora is None:
            return None
        try:
            return self.engine.lora.identity(name)[1]
        except ValueError:
            return None

    def check_digest(self, name: str, digest: str) -> None:
        """AdapterChanged unless ``name`` holds the weights of ``digest`` (any thread: the
        manager's registry is read under its lock)."""
        if self.digest_of(name) != digest:
            raise AdapterChanged(changed_message(name))

    def _known(self, name: str) -> None:
        if name not in {a.name for a in self.listed()}:
            raise EngineRejected(f"unknown adapter {name!r}", None, 404)


def _without_paths(message: str, *paths: str) -> str:
    """message with every given path (longest first: one may contain another) as <path>."""
    for path in sorted({p for p in paths if p}, key=len, reverse=True):
        message = message.replace(repr(path), "<path>").replace(path, "<path>")
    return message
