"""Adapters given on a gateway's command line (``--lora``, ``--adapter-dir``, the model's
demo adapters) exist while they are given, as in vLLM's ``--lora-modules``.

They live in the state store beside registered and uploaded ones, so that an admin may
change who uses them (a PATCH of owner or shared_with stands across restarts), and are told
apart by having no digest: the operator's own directories are trusted by name, not checked
against content validated at registration. At each start (and when a Redis that lost its
data is refilled) the store is brought to the command line: a name given now is added, or
pointed at the path given now; a name an earlier start was given, and this one is not, is
deleted the way an admin's DELETE deletes (unloaded from every engine first). Otherwise it
would stay listed in /v1/models while no engine may load it (engines load adapters under
their adapter roots only, which follow the command line).

Gateway replicas sharing one Redis are started with the same adapter flags: one started
without an adapter the others were given deletes it for all of them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping

from gateway.store import StateStore
from gateway.tenancy import AdapterRecord

log = logging.getLogger(__name__)


def from_command_line(record: AdapterRecord) -> bool:
    """Whether a record was made from a command line (not registered through the admin
    API, uploaded, or found by the resolver: those carry the digest they were validated
    with)."""
    return record.digest is None and record.upload_id is None


async def bring_to_command_line(store: StateStore, given: Mapping[str, str],
                                kept: Collection[str] = ()) -> list[str]:
    """Make the store's command-line adapters those in ``given`` (name -> path): add the
    new, move those whose path changed, and mark for deletion (``deleting``: PendingDeletes
    finishes it) those given before but not now, except names in ``kept`` (demo adapters
    still being trained, registered as they appear; an adapter directory's member that did
    not load this time: its record stands, with who may use it). A record an admin
    registered under a given name stands. Returns the names marked for deletion."""
    adapters = (await store.snapshot()).adapters
    for name, path in given.items():
        known = adapters.get(name)
        if known is None:
            await store.swap_adapter(name, None, AdapterRecord(name, path))
        elif not from_command_line(known):
            log.warning("adapter %s given on the command line is not served from %s: the "
                        "name belongs to an adapter registered through the admin API or "
                        "uploaded (delete that one to serve this)", name, path)
        elif known.path != path and not known.deleting and \
                await store.swap_adapter(name, known, dataclasses.replace(known, path=path)):
            log.info("adapter %s: now served from %s (was %s)", name, path, known.path)
    retired = [name for name, known in adapters.items()
               if from_command_line(known) and not known.deleting and name not in given
               and name not in kept and await store.swap_adapter(
                   name, known, dataclasses.replace(known, deleting=True))]
    if retired:
        log.info("adapters given on an earlier start's command line and not on this one are "
                 "deleted: %s", ", ".join(sorted(retired)))
    return retired
