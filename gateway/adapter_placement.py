"""Adapter placement: a request runs on an instance only once that instance holds its
adapter's registered weights.

The gateway's record of an adapter (path and digest, in the shared StateView) is the truth;
what an instance holds may be stale (a registration that lost a race unloads its own
weights) or other weights under the same name (an adapter deleted and registered again).
Invariant: a request never runs on weights other than its record's; the engine enforces it
too, refusing a request whose digest it does not hold ("adapter_changed").
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

from engine.http.errors import ApiError
from engine.protocol import ChunkStream, EngineRejected, EngineUnavailable
from gateway.auth import StateView
from gateway.instances import Instance
from gateway.job import Job
from gateway.tenancy import AdapterRecord

log = logging.getLogger(__name__)


class AdapterPlacement:
    """Loads adapters on instances lazily and opens requests on their registered weights."""

    def __init__(self, view: StateView, retry_after_s: int) -> None:
        self.view = view
        self.retry_after_s = retry_after_s

    async def ensure(self, instance: Instance, adapter: str) -> str | None:
        """Make the instance hold the registered content of the adapter before a request
        runs there: registered lazily on first use, and reloaded when the instance holds
        other weights under that name (its digest differs from the record's: an adapter
        deleted and registered again). Never runs a request on other weights: 503 (retry)
        while the engine's old adapter of that name is still in use, 500 if the files
        changed since registration. A record without a digest (command line) is trusted
        by name. EngineUnavailable passes through (the caller tries another instance).
        Returns the record's digest: the weights a request must run on.

        The record is read again once a load ends: an adapter deleted (or replaced)
        through another replica while this one loaded it would otherwise stay on the
        engine with no record that ever unloads it, and the request would run on it."""
        record = self._live(adapter)
        state = instance.adapters.get(adapter)
        if state is not None and record.digest in (None, state.digest):
            return record.digest
        try:
            info = await instance.client.load_adapter(adapter, record.path)
        except EngineRejected as exc:
            await self.view.fresh()
            self._live(adapter, record)  # deleted meanwhile: its files may be gone
            # The engine's reason may name paths: logged, not sent to the tenant.
            log.error("instance %s refused adapter %s: %s", instance.instance_id, adapter,
                      exc.message)
            if exc.status == 409:
                raise self.busy(adapter) from None
            raise ApiError(500, f"adapter {adapter!r} could not be loaded on an engine",
                           code="adapter_load_failed") from None
        digest = info.digest
        instance.note_loaded(record.path, info)
        await self.view.fresh()
        try:
            self._live(adapter, record)
        except ApiError:
            log.warning("adapter %s was deleted or replaced while %s loaded it; unloading "
                        "it there", adapter, instance.instance_id)
            instance.note_unloaded(adapter)
            with contextlib.suppress(EngineRejected, EngineUnavailable):
                await instance.client.unload_adapter(adapter, digest)
            raise
        if record.digest is not None and digest != record.digest:
            log.error("adapter %s on %s: the files at %s changed since it was registered",
                      adapter, instance.instance_id, record.path)
            raise ApiError(500, f"adapter {adapter!r} could not be loaded: its files changed "
                           f"since it was registered", code="adapter_load_failed")
        return record.digest

    def _live(self, adapter: str, expected: AdapterRecord | None = None
                     ) -> AdapterRecord:
        """The adapter's record as the view holds it: 404 when it is gone or being deleted,
        503 (retry) when it is no longer ``expected`` (registered again meanwhile)."""
        record = self.view.snapshot.adapters.get(adapter)
        if record is None or record.deleting:
            raise ApiError(404, f"The model '{adapter}' does not exist",
                           code="model_not_found", param="model")
        if expected is not None and (record.path, record.digest) != (expected.path,
                                                                     expected.digest):
            raise self.busy(adapter)
        return record

    def busy(self, adapter: str) -> ApiError:
        return ApiError(503, f"adapter {adapter!r} is being replaced on an engine; retry "
                        f"shortly", code="adapter_busy",
                        headers={"Retry-After": str(self.retry_after_s)})

    async def open_on(self, instance: Instance, job: Job) -> ChunkStream:
        """Open the job on the instance, with its adapter's registered weights. What the
        gateway knows the instance holds may be stale (a registration that lost a race
        unloads its own weights, which may have replaced these): the engine refuses a
        request whose weights it does not hold ("adapter_changed"), and the adapter is
        loaded there again, once."""
        if job.adapter is None:
            return await instance.client.open(job.request)
        for _attempt in range(2):
            digest = await self.ensure(instance, job.adapter)
            try:
                return await instance.client.open(replace(job.request, adapter_digest=digest))
            except EngineRejected as exc:
                if exc.code != "adapter_changed":
                    raise
                log.warning("adapter %s on %s: not the registered weights; loading them "
                            "again (%s)", job.adapter, instance.instance_id, exc.message)
                instance.adapters.pop(job.adapter, None)
        raise self.busy(job.adapter)
