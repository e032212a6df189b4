"""Fault isolation: a step that raises fails the request that caused it, never the batch.

Requests are validated at admission, so a step should never raise; if one does anyway (a
bug, or an input no check foresaw), the engine must not fail every tenant's request for
one request's sake. The scheduler rolls the failed step back (its requests start over by
recompute) and they become suspects:

    normal step fails            -> every request it scheduled becomes a suspect
    suspects remain              -> the next step runs the oldest suspect alone (focus)
    a focused step fails         -> that suspect is the culprit: it ends with an error
    a focused step samples       -> that suspect is cleared
    the focus cannot be scheduled (no slot, no blocks)
                                 -> a normal step runs without any suspect instead, so the
                                    others keep going and free what the focus waits for

Each failure either names a culprit or turns innocent requests into suspects that are
cleared one solo step each, so the engine always makes progress.
"""

from __future__ import annotations

from collections.abc import Container

from engine.scheduler_output import SchedulerOutput


class FaultIsolation:
    """Suspects of failed steps, in the order they became suspects."""

    def __init__(self) -> None:
        self._suspects: dict[str, None] = {}  # an ordered set

    @property
    def suspects(self) -> list[str]:
        return list(self._suspects)

    def plan(self, live: Container[str]) -> tuple[str | None, frozenset[str]]:
        """(focus, excluded) for the next step; suspects that ended meanwhile are dropped."""
        for request_id in [r for r in self._suspects if r not in live]:
            del self._suspects[request_id]
        if not self._suspects:
            return None, frozenset()
        return next(iter(self._suspects)), frozenset(self._suspects)

    def succeeded(self, sched: SchedulerOutput) -> None:
        """A step ran: suspects that sampled a token in it are cleared."""
        if self._suspects:
            for chunk in sched.chunks:
                if chunk.sample:
                    self._suspects.pop(chunk.request_id, None)

    def failed(self, scheduled: list[str], focus: str | None) -> list[str]:
        """A step that scheduled ``scheduled`` raised; returns the culprits to fail."""
        if focus is not None and scheduled == [focus]:
            del self._suspects[focus]
            return [focus]
        for request_id in scheduled:
            self._suspects[request_id] = None
        return []
