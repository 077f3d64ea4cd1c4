"""The ZeroMQ KV-event publisher: PUB for the stream, ROUTER for replays, one thread for both.

Wire protocol (vLLM's ``ZmqEventPublisher``)::

    PUB     multipart (topic, seq as 8-byte big-endian unsigned, msgpack KVEventBatch)
    ROUTER  a client (REQ or DEALER with an empty delimiter) sends the first seq it wants as
            8 bytes big-endian; the reply is one (seq, payload) message per buffered batch
            with seq >= that, then (-1 as 8-byte big-endian signed, b"") as the end marker

``seq`` starts at 0 and grows by one per batch, so a subscriber sees a gap as a jump.
``publish`` is called from one thread (the engine's step loop).

Never blocking the step loop: :meth:`ZmqEventPublisher.publish` puts the batch on a bounded
queue without waiting (encoding happens in the thread); a full queue drops the batch and counts
it and its events (``PublisherStats.num_*_dropped``, ``pagedkv_kv_events_dropped_total``). The
batch's sequence number is taken all the same, so a consumer sees the drop as a gap, asks the
replay socket, does not get it, and knows its index is incomplete. The PUB socket drops
messages for a slow subscriber at its high-water mark (ZeroMQ's PUB semantics); those gaps the
replay buffer fills. No consumer, slow or absent, ever blocks the publisher thread either.

Sockets are created and bound in the constructor (a taken port raises there, at start-up) and
used only by the publisher thread from then on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from pagedkv.core.events import KVEvent
from pagedkv.errors import InvalidRequestError
from pagedkv.kvevents.config import KVEventsConfig
from pagedkv.kvevents.wire import encode_batch, make_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay marker (the payload frame is empty)."""


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """Totals since start: batches sent on PUB, batches and events dropped by the full queue,
    replay requests served."""

    num_batches_published: int
    num_events_published: int
    num_batches_dropped: int
    num_events_dropped: int
    num_replays: int
    queue_len: int


class ZmqEventPublisher:
    """Publishes KV events from a thread; :meth:`publish` never blocks.

    Invariants:
      P1  every published batch gets the next sequence number (0, 1, 2, ...) when it is handed
          to publish(), kept or dropped, so a batch the full queue dropped is a gap on the wire
      P2  the replay buffer holds the last ``buffer_steps`` published (seq, payload), in order
    """

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(config.endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            replay = config.resolved_replay_endpoint()
            self.replay_endpoint: str | None = None
            if replay is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise InvalidRequestError(f"cannot bind KV events socket: {exc}") from None
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[tuple[int, float, Sequence[KVEvent]] | None] = queue.Queue(
            config.max_queue_batches
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)  # P2
        self._next_seq = 0  # P1; only publish() (the step thread) advances it
        self._lock = threading.Lock()  # guards the counters below
        self._num_batches = self._num_events = 0
        self._num_batches_dropped = self._num_events_dropped = self._num_replays = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay %s)", self.endpoint, self.replay_endpoint)

    def publish(self, events: Sequence[KVEvent]) -> bool:
        """Queue one batch (the events of one step); False when dropped (queue full or closed)."""
        if not events:
            return True
        seq = self._next_seq
        self._next_seq += 1
        try:
            if self._closed:
                raise queue.Full
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            with self._lock:
                self._num_batches_dropped += 1
                self._num_events_dropped += len(events)
            return False
        return True

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch handed to :meth:`publish` (-1 before the
        first); read it on the publishing thread or while that thread is held off."""
        return self._next_seq - 1

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(
                self._num_batches,
                self._num_events,
                self._num_batches_dropped,
                self._num_events_dropped,
                self._num_replays,
                self._queue.qsize(),
            )

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``timeout_s``), stop the thread, close the sockets.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            logger.warning("KV events queue still full at close; dropping what is left")
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # pragma: no cover - a wedged socket
            logger.warning("KV events thread did not stop within %.1f s", timeout_s)
            return
        self._close_sockets()

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("KV events replay failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events = item
            payload = encode_batch(make_batch(events, ts, self.config.data_parallel_rank))
            try:
                # NOBLOCK: a PUB socket never blocks anyway (it drops at the HWM)
                self._pub.send_multipart(
                    (self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                )
            except zmq.ZMQError:
                logger.exception("KV events send failed (seq %d stays replayable)", seq)
            self._buffer.append((seq, payload))
            with self._lock:
                self._num_batches += 1
                self._num_events += len(events)

    def _serve_replay(self) -> None:
        assert self._replay is not None  # only called with a replay socket
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
        with self._lock:
            self._num_replays += 1

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
