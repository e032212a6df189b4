"""KV cache events in vLLM's wire format, for routers that keep an exact index of the blocks
each engine holds (llm-d's precise prefix-cache scorer, the Gateway API Inference
Extension's, and later our own gateway).

The prefix cache tells a KVEventPublisher (a prefix_cache.cache.CacheEventSink) of every
block that becomes cached or is evicted, in order; LLMEngine.step() calls flush() once per
step, which publishes the step's events as one batch (nothing when nothing changed).

Wire format, as vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py):

    PUB socket     multipart [topic, seq (8 bytes, big-endian, from 0), payload]
    payload        msgpack of KVEventBatch: [ts, [event, ...], data_parallel_rank]
    events         "array" (default): [tag, fields...] (msgspec array_like + tag), as
                   vLLM before PR #42892 and every llm-d release decode them;
                   "map": {"type": tag, field: value, ...}, as vLLM 0.26+ sends them
    replay socket  ROUTER: a request [b"", start seq (8 bytes, big-endian)] is answered
                   with [b"", seq, payload] for every buffered batch from start on, then
                   [b"", -1 (8 bytes, signed), b""]

Block hashes are our 128-bit chain hashes (prefix_cache.hashing) cut to their low 64 bits,
sent as msgpack unsigned ints: what vLLM sends by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
=1 takes the low 64 bits of its hash), and what llm-d reads from a bytes hash (its last 8
bytes, big-endian), so a consumer masks its own chain hashes the same way (external_hash).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Literal

import msgspec
import zmq

from prefix_cache.index import EXTERNAL_MASK

log = logging.getLogger(__name__)

EventFormat = Literal["array", "map"]
MEDIUM_GPU = "GPU"
"""vLLM's name for the engine's own KV pool (its CPU backend reports it too): our blocks
live there, on a GPU or in host memory; swap space holds no cached blocks."""

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
def external_hash(block_hash: int) -> int:
    """The 64-bit hash a chain hash is published under (msgpack ints stop at 64 bits)."""
    return block_hash & EXTERNAL_MASK


# ------------------------------------------------------------------ wire structs
# Field names and order are vLLM's: consumers decode positionally ("array") or by name.
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events encoded as [tag, fields...]."""


class BlockStored(_ArrayEvent):
    """Consecutive blocks of one chain became cached; token_ids holds all their tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_ArrayEvent):
    """Blocks were evicted (their hashes no longer hit)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_ArrayEvent):
    """Every cached block was dropped."""


# vLLM 0.26+ encodes events as maps with the tag under "type"; the tag stays vLLM's name.
class BlockStoredMap(BlockStored, array_like=False, tag="BlockStored"):
    """BlockStored encoded as a map."""


class BlockRemovedMap(BlockRemoved, array_like=False, tag="BlockRemoved"):
    """BlockRemoved encoded as a map."""


class AllBlocksClearedMap(AllBlocksCleared, array_like=False, tag="AllBlocksCleared"):
    """AllBlocksCleared encoded as a map."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events; an array in both formats."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def for_instance(endpoint: str | None, index: int) -> str | None:
    """The endpoint of the index-th of several engines started from one config: a TCP
    port offset by the index (as vLLM offsets by data-parallel rank), an ipc/inproc path
    suffixed with it. Index 0 keeps the endpoint as given."""
    if endpoint is None or index == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + index}"
    return f"{endpoint}-{index}"


# --------------------------------------------------------------------- publisher
def _open(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, endpoint: str
          ) -> zmq.Socket[bytes]:
    """Bind a wildcard, ipc or inproc endpoint, connect to anything else (vLLM's rule: a
    router that binds, as llm-d's does, is given its address and the engine connects)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


class KVEventPublisher:
    """Collects the prefix cache's changes and publishes one batch per step over ZMQ.

    The step thread encodes, numbers, buffers and sends (a PUB socket never blocks: past its
    high-water mark it drops, and the subscriber sees the gap). A daemon thread owns the
    replay socket, so a subscriber that missed batches can fetch them from the buffer.
    """

    def __init__(self, endpoint: str, block_size: int, replay_endpoint: str | None = None,
                 topic: str = "", buffer_steps: int = 10_000,
                 event_format: EventFormat = "array", data_parallel_rank: int = 0,
                 hwm: int = 100_000) -> None:
        self.block_size = block_size
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._map = event_format == "map"
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._removed: list[int] = []  # consecutive removals become one BlockRemoved
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()  # the buffer is read by the replay thread
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = _open(self._ctx, zmq.PUB, endpoint)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(replay_endpoint)  # subscribers always connect to it
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(replay,), name="kv-events-replay",
                daemon=True)
            self._replay_thread.start()
        self.num_published = 0

    # ---------------------------------------------- CacheEventSink (step thread)
    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
               lora_name: str | None) -> None:
        self._end_removed()
        cls = BlockStoredMap if self._map else BlockStored
        self._pending.append(cls(
            block_hashes=[external_hash(h) for h in hashes],
            parent_block_hash=None if parent is None else external_hash(parent),
            token_ids=list(token_ids), block_size=self.block_size,
            lora_id=None,  # vLLM's deprecated int id: our adapters have names only
            medium=MEDIUM_GPU, lora_name=lora_name))

    def removed(self, block_hash: int) -> None:
        self._removed.append(external_hash(block_hash))

    def cleared(self) -> None:
        self._end_removed()
        self._pending.append(AllBlocksClearedMap() if self._map else AllBlocksCleared())

    def _end_removed(self) -> None:
        if self._removed:
            cls = BlockRemovedMap if self._map else BlockRemoved
            self._pending.append(cls(block_hashes=self._removed, medium=MEDIUM_GPU))
            self._removed = []

    # ----------------------------------------------------------------- publishing
    def flush(self) -> None:
        """Publish the events collected since the last flush as one batch, if any."""
        self._end_removed()
        if not self._pending:
            return
        batch = KVEventBatch(ts=time.time(), events=self._pending,
                             data_parallel_rank=self._rank)
        self._pending = []
        payload = self._encoder.encode(batch)
        seq = self._seq.to_bytes(8, "big")
        with self._lock:
            self._buffer.append((self._seq, payload))
        self._seq += 1
        try:
            self._pub.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # at the high-water mark: the batch stays in the replay buffer
            log.warning("kv events: PUB queue full, batch %d only in the replay buffer",
                        self._seq - 1)
        self.num_published += 1

    def _serve_replay(self, sock: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100):  # wake up now and then to notice close()
                    continue
                frames = sock.recv_multipart()
                # [identity, b"", start] from REQ (and DEALER with a delimiter), or
                # [identity, start] from a bare DEALER: answer in the same envelope.
                if len(frames) not in (2, 3) or len(frames[-1]) != 8:
                    log.warning("kv events: ignoring a malformed replay request")
                    continue
                envelope = frames[:-1]
                start = int.from_bytes(frames[-1], "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for s, payload in batches:
                    sock.send_multipart([*envelope, s.to_bytes(8, "big"), payload])
                sock.send_multipart([*envelope, END_OF_REPLAY, b""])
        finally:
            sock.close()

    def close(self) -> None:
        """Stop the replay thread and close the sockets (pending events are dropped)."""
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        self._pub.close()
