"""KV events on a real ZeroMQ socket decode as vLLM's, replay after a gap, never block.

vLLM's message definitions are re-declared below from its documented subscriber
(``examples/online_serving/kv_events_subscriber.py``: array-like msgspec structs, events tagged
by class name) with ``ExternalBlockHash = bytes | int`` as ``vllm/distributed/kv_events.py``
has it. vLLM itself is never imported.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.errors import InvalidRequestError
from pagedkv.kvevents.config import KVEventsConfig
from pagedkv.kvevents.publisher import END_SEQ, ZmqEventPublisher
from pagedkv.kvevents.subscriber import EventSubscriber


# ---------------------------------------------------------------- vLLM's structs, re-declared
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(EventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(type=VKVEventBatch)

H0, H1, H2 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16


@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    pub = ZmqEventPublisher(KVEventsConfig("tcp://127.0.0.1:*"))
    yield pub
    pub.close()


def _sub(pub: ZmqEventPublisher) -> zmq.Socket[bytes]:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    sub.connect(pub.endpoint)
    return sub


def _wait_connected(pub: ZmqEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish probes until the SUB receives one (ZeroMQ's slow joiner); the next seq."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()])
        if sub.poll(50):
            seq = int.from_bytes(sub.recv_multipart()[1], "big")
            while sub.poll(100):  # drain probes still in flight
                seq = int.from_bytes(sub.recv_multipart()[1], "big")
            return seq + 1
    pytest.fail("SUB never connected")


def test_a_zmq_sub_decodes_the_stream_with_vllms_structs(publisher: ZmqEventPublisher) -> None:
    sub = _sub(publisher)
    try:
        next_seq = _wait_connected(publisher, sub)
        t0 = time.time()
        publisher.publish(
            [
                BlockStored((H0, H1), None, tuple(range(8)), 4),
                BlockStored((H2,), H1, (9, 9, 9, 9), 4, lora_name="ad", medium="host"),
                BlockRemoved((H0,)),
                BlockRemoved((H2,), medium="redis"),
                AllBlocksCleared(),
            ]
        )
        assert sub.poll(2000)
        topic, seq_bytes, payload = sub.recv_multipart()
    finally:
        sub.close()
    assert topic == b"kv-events"
    assert len(seq_bytes) == 8
    assert int.from_bytes(seq_bytes, "big") == next_seq
    batch = VLLM_DECODER.decode(payload)
    assert t0 - 1 <= batch.ts <= time.time()
    assert batch.data_parallel_rank == 0
    assert batch.events == [
        VBlockStored([H0, H1], None, list(range(8)), 4, None, "GPU"),
        VBlockStored([H2], H1, [9, 9, 9, 9], 4, None, "cpu"),
        VBlockRemoved([H0], "GPU"),
        VBlockRemoved([H2], "redis"),
        VAllBlocksCleared(),
    ]
    # the raw form is vLLM's: [ts, [[tag, fields...], ...], rank]
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockStored"
    assert raw[1][4] == ["AllBlocksCleared"]
    assert raw[1][1][-1] == "ad"  # lora_name trails the six documented fields


def test_replay_serves_a_range_the_subscriber_missed(publisher: ZmqEventPublisher) -> None:
    for i in range(5):  # nobody is subscribed: these are lost on PUB, kept for replay
        publisher.publish([BlockStored((bytes([i]) * 16,), None, (i,) * 4, 4)])
    deadline = time.monotonic() + 5
    while publisher.stats().num_batches_published < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert publisher.replay_endpoint is not None
    # a DEALER, not a REQ: the reply is many messages (a REQ socket takes only the first)
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(publisher.replay_endpoint)
    try:
        req.send_multipart((b"", (2).to_bytes(8, "big")))
        got: list[tuple[int, VKVEventBatch]] = []
        while req.poll(2000):
            empty, seq_bytes, payload = req.recv_multipart()
            assert empty == b""
            if seq_bytes == END_SEQ:
                assert payload == b""
                break
            got.append((int.from_bytes(seq_bytes, "big"), VLLM_DECODER.decode(payload)))
    finally:
        req.close()
    assert [s for s, _ in got] == [2, 3, 4]
    stored = [b.events[0] for _, b in got]
    assert all(isinstance(e, VBlockStored) for e in stored)
    assert [e.token_ids for e in stored] == [[2] * 4, [3] * 4, [4] * 4]  # type: ignore[union-attr]


def test_subscriber_joins_late_and_fills_a_gap_from_replay(publisher: ZmqEventPublisher) -> None:
    for i in range(3):
        publisher.publish([BlockRemoved((bytes([i]) * 16,))])
    deadline = time.monotonic() + 5
    while publisher.stats().num_batches_published < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sub = EventSubscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        seen = [seq for seq, _ in sub.poll(100)]  # the joining snapshot: seq 0..2 by replay
        assert seen == [0, 1, 2]
        for i in range(3, 40):
            publisher.publish([BlockRemoved((bytes([i]) * 16,))])
        deadline = time.monotonic() + 5
        while sub.last_seq < 39 and time.monotonic() < deadline:
            seen += [seq for seq, _ in sub.poll(50)]
    finally:
        sub.close()
    assert seen == list(range(40))  # in order, no hole, no duplicate (gaps were replayed)
    assert sub.num_missed == 0


def test_publish_never_blocks_and_a_dropped_batch_is_a_gap_replay_cannot_fill() -> None:
    pub = ZmqEventPublisher(KVEventsConfig("tcp://127.0.0.1:*", max_queue_batches=2))
    try:
        batch = [BlockStored((H0,) * 64, None, tuple(range(256)), 4)]
        t0 = time.perf_counter()
        sent = sum(pub.publish(batch) for _ in range(3000))
        elapsed = time.perf_counter() - t0
        deadline = time.monotonic() + 10
        while pub.stats().queue_len and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.publish(batch)  # the queue has room again: seq 3000 is kept
        deadline = time.monotonic() + 10
        while pub.stats().num_batches_published < sent + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = pub.stats()
        sub = EventSubscriber(pub.endpoint, pub.replay_endpoint)
        try:
            seqs = [seq for seq, _ in sub.poll(100)]  # the joining replay: what was sent
        finally:
            sub.close()
    finally:
        pub.close()
    assert elapsed < 2.0  # 3000 non-blocking puts (a blocked put would wait for the thread)
    assert stats.num_batches_dropped > 0
    assert stats.num_batches_dropped + stats.num_batches_published == 3001
    assert stats.num_batches_published == sent + 1 == len(seqs)
    assert stats.num_events_dropped == stats.num_batches_dropped
    assert seqs == sorted(seqs)
    assert seqs[-1] == 3000  # numbered after the dropped ones: they are holes on the wire ...
    assert sub.num_missed == stats.num_batches_dropped  # ... which the subscriber counted


def test_bad_endpoints_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="tcp://HOST:PORT"):
        KVEventsConfig("127.0.0.1:5557")
    pub = ZmqEventPublisher(KVEventsConfig("tcp://127.0.0.1:*", replay_endpoint=""))
    try:
        assert pub.replay_endpoint is None
        with pytest.raises(InvalidRequestError, match="cannot bind"):
            ZmqEventPublisher(KVEventsConfig(pub.endpoint, replay_endpoint=""))
    finally:
        pub.close()
