"""The store's command-line adapters follow the command line (gateway/configured_adapters.py):
on the real stores, a name given is added or moved, one no longer given is marked for
deletion, and the others stand: registered, uploaded, kept (a member that did not load)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import pytest

from gateway.configured_adapters import bring_to_command_line
from gateway.store import StateStore
from gateway.tenancy import AdapterRecord

EARLIER = [AdapterRecord("moved", "/old/moved", owner="acme"),  # an admin's PATCH on it
           AdapterRecord("dropped", "/old/dropped"),
           AdapterRecord("broken", "/old/broken", owner="acme"),
           AdapterRecord("registered", "/srv/registered", digest="d1"),
           AdapterRecord("uploaded", "/up/x", upload_id="u1")]


def test_the_store_follows_the_command_line(make_store: Callable[[], StateStore],
                                            caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> dict[str, AdapterRecord]:
        store = make_store()
        try:
            for record in EARLIER:
                assert await store.swap_adapter(record.name, None, record)
            given = {"moved": "/new/moved", "new": "/new/new", "registered": "/mine/r"}
            retired = await bring_to_command_line(store, given, kept={"broken"})
            assert retired == ["dropped"]
            return (await store.snapshot()).adapters
        finally:
            await store.close()

    with caplog.at_level(logging.WARNING, "gateway.configured_adapters"):
        adapters = asyncio.run(scenario())
    assert adapters["moved"] == dataclasses.replace(EARLIER[0], path="/new/moved")
    assert adapters["new"] == AdapterRecord("new", "/new/new")
    assert adapters["dropped"].deleting  # PendingDeletes unloads it, then drops it
    for kept in (EARLIER[2], EARLIER[3], EARLIER[4]):
        assert adapters[kept.name] == kept
    assert "adapter registered given on the command line is not served from /mine/r" in \
        caplog.text
