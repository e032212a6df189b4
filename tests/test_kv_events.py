"""KV events in vLLM's format: a subscriber written from vLLM's documented schema (its own
structs, not engine/kv_events.py's) keeps an exact index of a live engine's cached blocks,
and fills gaps from the replay socket."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from engine.config import EngineConfig
from engine.kv_events import KVEventPublisher, external_hash, for_instance
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from prefix_cache.hashing import chain_hashes

BS = 4
END = (-1).to_bytes(8, "big", signed=True)


# vllm/distributed/kv_events.py's schema, as its examples/online_serving/kv_events_subscriber.py
# spells it for subscribers (positional arrays, tagged events).
class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class KVEventBatch(Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM 0.26+: events as maps with the tag under "type", the batch still an array.
class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(Batch):
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


class Subscriber:
    """An indexer as a router would run one: SUB for live batches, DEALER for replays."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, replay: str) -> None:
        self.ctx, self.endpoint = ctx, endpoint
        self.sub = self._connect_sub()
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq = 0
        self.applied: list[int] = []
        self.num_replayed = 0
        self.num_removed = 0
        self.index: set[int] = set()
        self.tokens_of: dict[int, list[int]] = {}

    def _connect_sub(self) -> zmq.Socket[bytes]:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        return sub

    def drop(self) -> None:
        """Go away (a subscriber restart, a network cut): what is sent meanwhile is lost."""
        self.sub.close()

    def rejoin(self) -> None:
        self.sub = self._connect_sub()

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq
        for event in self.decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                assert event.medium == "GPU" and event.block_size == BS
                assert len(event.token_ids) == BS * len(event.block_hashes)
                for i, h in enumerate(event.block_hashes):
                    assert h not in self.index, "stored twice without a removal"
                    self.index.add(h)
                    self.tokens_of[h] = event.token_ids[i * BS:(i + 1) * BS]
            elif isinstance(event, BlockRemoved):
                assert event.medium == "GPU"
                for h in event.block_hashes:
                    self.index.remove(h)  # KeyError: removed what was never stored
                    self.num_removed += 1
            else:
                self.index.clear()
        self.applied.append(seq)
        self.next_seq += 1

    def pump(self, timeout_ms: int = 0) -> None:
        while not self.sub.closed and self.sub.poll(timeout_ms):
            timeout_ms = 0
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:
                self.fill_gap()
            if seq == self.next_seq:
                self.apply(seq, payload)

    def fill_gap(self) -> None:
        """Ask for everything from next_seq on; the reply ends with seq -1."""
        self.replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            assert self.replay.poll(5000), "no answer from the replay socket"
            _empty, seq_bytes, payload = self.replay.recv_multipart()
            if seq_bytes == END:
                assert payload == b""
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= self.next_seq:
                self.apply(seq, payload)
                self.num_replayed += 1

    def close(self) -> None:
        self.sub.close()
        self.replay.close()


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts over a few shared prefixes, so blocks are reused, shared and evicted."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 500) for _ in range(3 * BS)] for _ in range(3)]
    return [rng.choice(prefixes)[:rng.choice((BS, 2 * BS, 3 * BS))]
            + [rng.randrange(1, 500) for _ in range(rng.randrange(2, 5 * BS))]
            for _ in range(n)]


def _engine(model: Path, tmp_path: Path) -> tuple[LLMEngine, str, str]:
    pub, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    engine = LLMEngine.from_model(
        str(model), block_size=BS, num_kv_blocks=24, max_num_batched_tokens=32,
        max_model_len=64, prefix_publish_every=1, kv_events_endpoint=pub,
        kv_events_replay_endpoint=replay, kv_events_buffer_steps=100_000)
    return engine, pub, replay


def _run(engine: LLMEngine, sub: Subscriber, prompts: list[list[int]], tag: str,
         drop_after: int | None = None) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, params)
        if i % 4 == 3 or i == len(prompts) - 1:
            while engine.has_unfinished_requests():
                engine.step()
                sub.pump()
        if drop_after is not None and i == drop_after:
            sub.drop()
        if drop_after is not None and i == drop_after + 8:
            sub.rejoin()


def _engine_index(engine: LLMEngine) -> set[int]:
    # With prefix_publish_every=1 a full publication lists every cached hash.
    update = engine.publish_prefixes(0)
    assert update.full
    return {external_hash(h) for h in update.added}


def test_subscriber_index_equals_engine_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine, pub, replay = _engine(tiny_model_dir, tmp_path)
    assert engine.kv_events is not None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = Subscriber(ctx, pub, replay)
    try:
        prompts = _prompts(40, seed=0)
        _run(engine, sub, prompts, "r")
        sub.pump(200)
        sub.fill_gap()  # batches sent before the SUB was connected, or after the last read
        assert sub.num_removed > 0, "the workload should have evicted blocks"
        assert sub.index == _engine_index(engine)
        assert sub.applied == list(range(engine.kv_events.num_published))
        # Every cached prompt block carries its tokens and its chain hash.
        for prompt in prompts:
            for i, h in enumerate(chain_hashes(prompt, BS)):
                if external_hash(h) in sub.tokens_of:
                    assert sub.tokens_of[external_hash(h)] == prompt[i * BS:(i + 1) * BS]
    finally:
        sub.close()
        engine.kv_events.close()
        ctx.term()


def test_dropped_subscriber_fills_the_gap_by_replay(tiny_model_dir: Path, tmp_path: Path
                                                   ) -> None:
    engine, pub, replay = _engine(tiny_model_dir, tmp_path)
    assert engine.kv_events is not None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = Subscriber(ctx, pub, replay)
    try:
        _run(engine, sub, _prompts(32, seed=1), "d", drop_after=7)
        sub.pump(200)
        assert sub.num_replayed > 0, "the gap should have been filled by replay"
        sub.fill_gap()
        assert sub.applied == list(range(engine.kv_events.num_published))
        assert sub.index == _engine_index(engine)
    finally:
        sub.close()
        engine.kv_events.close()
        ctx.term()


def _collect(fmt: str, tmp_path: Path) -> tuple[bytes, bytes]:
    """Publish one hand-made batch and receive it: (topic, payload)."""
    endpoint = f"ipc://{tmp_path}/kv-{fmt}"
    publisher = KVEventPublisher(endpoint, block_size=2, topic="kv@pod@model",
                                 event_format="map" if fmt == "map" else "array")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(endpoint)
    try:
        for _ in range(50):  # the slow joiner: publish until the subscription is through
            publisher.removed(7)
            publisher.flush()
            if sub.poll(100):
                sub.recv_multipart()
                break
        publisher.stored([(1 << 100) + 5, 6], None, [1, 2, 3, 4], "a0")
        publisher.removed(5)
        publisher.removed(6)
        publisher.cleared()
        publisher.flush()
        publisher.flush()  # nothing new: no batch
        assert sub.poll(2000)
        topic, _seq, payload = sub.recv_multipart()
        assert not sub.poll(100)
        return topic, payload
    finally:
        sub.close(linger=0)
        publisher.close()
        ctx.term()


def test_event_encodings(tmp_path: Path) -> None:
    topic, payload = _collect("array", tmp_path)
    assert topic == b"kv@pod@model"
    raw = msgspec.msgpack.decode(payload)
    assert raw[1] == [["BlockStored", [5, 6], None, [1, 2, 3, 4], 2, None, "GPU", "a0"],
                      ["BlockRemoved", [5, 6], "GPU"], ["AllBlocksCleared"]]
    assert raw[2] == 0  # data_parallel_rank
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert isinstance(batch.events[2], AllBlocksCleared)

    _topic, payload = _collect("map", tmp_path)
    events = msgspec.msgpack.Decoder(MapKVEventBatch).decode(payload).events
    assert events == [MapBlockStored([5, 6], None, [1, 2, 3, 4], 2, None, "GPU", "a0"),
                      MapBlockRemoved([5, 6], "GPU"), MapAllBlocksCleared()]


def test_kv_events_are_off_by_default() -> None:
    assert EngineConfig(model="m").kv_events_endpoint is None
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineConfig(model="m", prefix_caching="off", kv_events_endpoint="tcp://*:5557")


def test_each_engine_of_one_config_gets_its_own_endpoint() -> None:
    assert for_instance("tcp://*:5557", 0) == "tcp://*:5557"
    assert for_instance("tcp://*:5557", 2) == "tcp://*:5559"
    assert for_instance("tcp://router:7000", 1) == "tcp://router:7001"
    assert for_instance("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-1"
    assert for_instance(None, 3) is None
