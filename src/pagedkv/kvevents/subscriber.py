"""A KV-event subscriber: SUB for the stream, a DEALER on the replay socket to fill gaps.

:meth:`EventSubscriber.poll` returns batches in sequence order without holes whenever the
publisher's replay buffer still holds the missing range:

* at start it asks the replay socket for everything after ``last_seq``: from seq 0 (what the
  engine published before this subscriber connected, as far as the buffer reaches), or, after
  :meth:`EventSubscriber.start_after` with a snapshot's seq, from the batch after the snapshot;
* a batch whose seq jumps past ``last_seq + 1`` triggers a replay from ``last_seq + 1``;
* what the replay cannot supply is counted in ``num_missed``; the consumer's index is then
  incomplete: a missed store loses hits, a missed removal leaves a stale entry (at worst a
  request goes to an engine that no longer holds its prefix and computes it there).

One subscriber is used by one thread.
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from pagedkv.kvevents.publisher import END_SEQ
from pagedkv.kvevents.wire import KVEventBatch, decode_batch

logger = logging.getLogger(__name__)


class EventSubscriber:
    """Receives ``(seq, KVEventBatch)`` from one publisher, replaying gaps."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "kv-events",
        *,
        replay_timeout_ms: int = 500,
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self.replay_timeout_ms = replay_timeout_ms
        self.last_seq = -1
        self.num_missed = 0  # batches neither received nor replayed
        self.num_replayed = 0
        self.num_bad = 0  # payloads that failed to decode (skipped)
        self._snapshot_pending = self._replay is not None

    def start_after(self, seq: int) -> None:
        """Take the stream from batch ``seq + 1`` on (the consumer holds a snapshot as of
        ``seq``): older batches are skipped, newer ones replayed. Call before the first poll."""
        self.last_seq = seq

    def poll(self, timeout_ms: int) -> list[tuple[int, KVEventBatch]]:
        """Batches received within ``timeout_ms`` (plus any replayed), in seq order."""
        out: list[tuple[int, KVEventBatch]] = []
        if self._snapshot_pending:
            self._snapshot_pending = False
            out.extend(self._replay_from(self.last_seq + 1, None))
        if not self._sub.poll(timeout_ms):
            return out
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 3:
                self.num_bad += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            if seq <= self.last_seq:
                continue  # already replayed
            if seq > self.last_seq + 1:
                out.extend(self._replay_from(self.last_seq + 1, seq))
                if seq > self.last_seq + 1:  # the replay did not reach it
                    self.num_missed += seq - self.last_seq - 1
            batch = self._decode(frames[2])
            self.last_seq = seq
            if batch is not None:
                out.append((seq, batch))

    def _replay_from(self, first: int, stop: int | None) -> list[tuple[int, KVEventBatch]]:
        """Ask for batches ``first..`` (until the end marker, or ``stop`` exclusive)."""
        if self._replay is None:
            return []
        out: list[tuple[int, KVEventBatch]] = []
        self._replay.send_multipart((b"", first.to_bytes(8, "big")))
        while self._replay.poll(self.replay_timeout_ms):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                self.num_bad += 1
                continue
            _, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq or (stop is not None and seq >= stop):
                continue
            if seq > self.last_seq + 1:
                self.num_missed += seq - self.last_seq - 1  # aged out of the replay buffer
            batch = self._decode(payload)
            self.last_seq = seq
            self.num_replayed += 1
            if batch is not None:
                out.append((seq, batch))
        return out

    def _decode(self, payload: bytes) -> KVEventBatch | None:
        try:
            return decode_batch(payload)
        except msgspec.DecodeError:
            self.num_bad += 1
            logger.warning("skipping a KV event batch that does not decode")
            return None

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
