"""The engine's preparing thread: where requests whose making may take long (a grammar to
compile, text to tokenize, bad words to spell) are made, off the event loop.

One thread, so that a flood of large grammars takes at most one core from the engine's steps
(on a 2-core host, a cached request beside 12 large compiles took 0.84 s with one, 1.39 s with
two); its own, not the loop's default pool, which serves other work of the process.

Fair between tenants: work queues per tenant, and the thread takes one item from each
tenant with queued work in turn. A tenant flooding it with new grammars waits behind its
own flood; another tenant's grammar waits for at most one item of each other tenant. The
tenant whose item runs takes its place in the turn order again only when that item ends,
so a tenant arriving meanwhile goes first: behind a flood of slow compiles it waits for the
one that runs, not for the next one too.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.engine_thread import EngineDeadError

T = TypeVar("T")

_Item = tuple[Callable[[], Any], "Future[Any]"]


class PreparingThread:
    """Runs work off the event loop, round-robin over tenants (FIFO within one); an engine
    error, never a bare cancellation, when the engine shuts down first (a gateway retries an
    engine error elsewhere)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        # Invariant: a key is in _turns exactly when its queue in _queues is non-empty and
        # it is not _running's (that one is put back when its item ends).
        self._queues: dict[str | None, deque[_Item]] = {}
        self._turns: deque[str | None] = deque()
        self._running: list[str | None] = []
        """The tenant whose item runs now (none or one)."""
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="loragate-prepare",
                                        daemon=True)
        self._thread.start()

    async def run(self, work: Callable[[], T], tenant: str | None = None) -> T:
        """work() on the thread, in ``tenant``'s turn (None: the operator, or a caller that
        names none). EngineDeadError when the engine shuts down before it ran (shutdown
        cancels queued work: the caller was not cancelled) or has shut down. Cancelling
        the caller drops its work if it has not started."""
        future: Future[T] = Future()
        with self._changed:
            if self._closed:
                raise EngineDeadError("the engine has shut down")
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = deque()
                if tenant not in self._running:
                    self._turns.append(tenant)
            queue.append((work, future))
            self._changed.notify()
        try:
            return await asyncio.wrap_future(future)  # a cancelled caller cancels `future`
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller's own cancellation
            raise EngineDeadError("the engine shut down while the request was being "
                                  "prepared") from None

    def queued(self) -> dict[str | None, int]:
        """Items waiting per tenant (cancelled ones included until their turn)."""
        with self._changed:
            return {tenant: len(queue) for tenant, queue in self._queues.items()}

    def shutdown(self, timeout: float = 30) -> None:
        """Refuse new work, cancel what is queued and wait for what runs to finish (up to
        ``timeout`` seconds). Joined, not left to die with the interpreter: a daemon thread
        still unwinding at exit may abort the process ("terminate called without an active
        exception")."""
        with self._changed:
            self._closed = True
            for queue in self._queues.values():
                for _, future in queue:
                    future.cancel()
            self._queues.clear()
            self._turns.clear()
            self._changed.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _next(self) -> _Item | None:
        """The next item in tenant turn order; None once shut down."""
        with self._changed:
            while not self._turns and not self._closed:
                self._changed.wait()
            if self._closed:
                return None
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            item = queue.popleft()
            if not queue:
                del self._queues[tenant]
            self._running[:] = [tenant]
            return item

    def _ended(self) -> None:
        """The running item ended: its tenant's next item, if any, after every tenant's
        now in the turn order (those that arrived while it ran included)."""
        with self._changed:
            tenant = self._running.pop()
            if tenant in self._queues:
                self._turns.append(tenant)

    def _serve(self) -> None:
        while (item := self._next()) is not None:
            work, future = item
            try:
                if not future.set_running_or_notify_cancel():
                    continue  # its caller went away while it was queued
                try:
                    result = work()
                except BaseException as exc:  # delivered to the caller, whatever it is
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            finally:
                self._ended()
