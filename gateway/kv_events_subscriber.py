"""The gateway's side of KV events (engine/kv_events.py): one subscriber per engine that
publishes them, feeding the router's prefix index block by block instead of the sparse
hashes it polls from /state, so an eviction counts at once and not at the next poll.

Each subscriber is a daemon thread with a ZMQ SUB socket (pyzmq is blocking; the event loop
only receives the decoded changes, through call_soon_threadsafe, in order). It expects
sequence numbers from 0: a subscriber that joins late, or misses batches, asks the engine's
replay socket for everything from the first missing one (the engine keeps a bounded
buffer), so the index ends up with every block the engine holds. Events are decoded in
both of vLLM's shapes (positional arrays and "type"-tagged maps).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

import msgspec
import zmq

log = logging.getLogger(__name__)
END_OF_REPLAY = -1
POLL_MS = 200
REPLAY_TIMEOUT_MS = 2000
Changes = Callable[[str, list[int], list[int], bool], None]
"""(engine id, hashes stored, hashes removed, cache cleared first)."""


def reachable(endpoint: str, engine_url: str | None) -> str:
    """An engine's configured endpoint as the gateway connects to it: a wildcard host
    ("tcp://*:5557") is the engine's own host (from its URL; loopback for an in-process
    engine)."""
    host = (urlsplit(engine_url).hostname if engine_url else None) or "127.0.0.1"
    return endpoint.replace("tcp://*:", f"tcp://{host}:").replace("tcp://0.0.0.0:",
                                                                    f"tcp://{host}:")


def decode_batch(payload: bytes) -> list[tuple[list[int], list[int], bool]]:
    """One batch's events as (stored, removed, cleared) changes, in order."""
    batch = msgspec.msgpack.decode(payload)
    changes: list[tuple[list[int], list[int], bool]] = []
    for event in batch[1]:
        if isinstance(event, dict):
            tag, hashes = event.get("type"), event.get("block_hashes") or []
        else:
            tag, hashes = event[0], (event[1] if len(event) > 1 else [])
        if tag == "BlockStored":
            changes.append((list(hashes), [], False))
        elif tag == "BlockRemoved":
            changes.append(([], list(hashes), False))
        elif tag == "AllBlocksCleared":
            changes.append(([], [], True))
    return changes


class KVEventSubscriber:
    """Follows one engine's KV events until stop()."""

    def __init__(self, engine_id: str, endpoint: str, replay_endpoint: str | None,
                 on_changes: Changes, loop: asyncio.AbstractEventLoop) -> None:
        self.engine_id = engine_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._on_changes = on_changes
        self._loop = loop
        self._stop = threading.Event()
        self.next_seq = 0
        """The sequence number expected next (every earlier batch is applied)."""
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kv-events-{engine_id}")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        try:
            self._replay()  # whatever the engine published before we joined
            while not self._stop.is_set():
                if not sub.poll(POLL_MS):
                    continue
                _, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.next_seq:
                    self._replay()  # a gap: fetch it before this batch
                if seq >= self.next_seq:  # past what replay could give: apply, lose the gap
                    self._apply(seq, payload)
        except Exception:  # a broken subscriber must not take the gateway down
            log.exception("KV events from %s stopped", self.engine_id)
        finally:
            sub.close()

    def _replay(self) -> None:
        if self.replay_endpoint is None:
            return
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
            while dealer.poll(REPLAY_TIMEOUT_MS):
                frames = dealer.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_OF_REPLAY:
                    return
                if seq >= self.next_seq:  # > : older batches left the engine's buffer
                    self._apply(seq, frames[-1])
            log.warning("no replay from %s; its index may miss blocks", self.engine_id)
        finally:
            dealer.close()

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq > self.next_seq:
            log.warning("KV events %d..%d from %s are lost; its index may be stale",
                        self.next_seq, seq - 1, self.engine_id)
        for stored, removed, cleared in decode_batch(payload):
            self._loop.call_soon_threadsafe(self._on_changes, self.engine_id, stored,
                                            removed, cleared)
        self.next_seq = seq + 1
