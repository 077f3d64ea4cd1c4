"""The host RAM tier: payloads in an LRU dictionary under a byte budget."""

from __future__ import annotations

from pagedkv.errors import InvalidRequestError, InvariantViolation
from pagedkv.tiers.base import LocalTier
from pagedkv.tiers.payload import TierLayout, read_header


class HostTier(LocalTier[bytes]):
    """Block payloads in host memory, least recently used evicted first.

    An ``OrderedDict`` keeps LRU order because it moves a key to the end and pops the oldest in
    O(1) without a separate linked list to keep in step. Payloads are kept as the immutable
    ``bytes`` they arrived as (no copy); memory is trusted, so reads skip the checksum (a
    payload's header is checked once, on ``put``).

    Invariants (check_invariants() verifies each):
      I1  num_bytes == sum of len(payload) over stored blocks
      I2  num_bytes <= capacity_bytes
    Complexity: every operation O(1) per block (contains_prefix O(run length)).
    """

    def __init__(self, layout: TierLayout, capacity_bytes: int, name: str = "host") -> None:
        super().__init__(name, layout, capacity_bytes)  # _lru: hash -> payload, LRU first

    def try_get(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            payload = self._lru.get(block_hash)
            if payload is None:
                self._counters.misses += 1
                return None
            self._lru.move_to_end(block_hash)
            self._counters.hits += 1
            self._counters.bytes_out += len(payload)
            return payload

    def put(self, block_hash: bytes, payload: bytes) -> bool:
        header = read_header(payload)
        if header.layout != self.layout or header.block_hash != block_hash:
            raise InvalidRequestError(
                f"payload for block {header.block_hash.hex()} ({header.layout.namespace}) "
                f"cannot be stored as {block_hash.hex()} in tier {self.layout.namespace}"
            )
        size = len(payload)
        with self._lock:
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)
                return True
            if size > self.capacity_bytes:
                self._counters.dropped_writes += 1
                return False
            while self._num_bytes + size > self.capacity_bytes:
                old_hash, old = self._lru.popitem(last=False)
                self._num_bytes -= len(old)
                self._counters.evictions += 1
                self._event_removed(old_hash)
            self._lru[block_hash] = payload
            self._num_bytes += size
            self._counters.bytes_in += size
            self._event_stored(block_hash)
            return True

    def delete(self, block_hash: bytes) -> bool:
        with self._lock:
            payload = self._lru.pop(block_hash, None)
            if payload is None:
                return False
            self._num_bytes -= len(payload)
            self._event_removed(block_hash)
            return True

    def check_invariants(self) -> None:
        with self._lock:
            total = sum(len(p) for p in self._lru.values())
            if total != self._num_bytes:
                raise InvariantViolation(f"I1: num_bytes {self._num_bytes} != sum {total}")
            if self._num_bytes > self.capacity_bytes:
                raise InvariantViolation(
                    f"I2: num_bytes {self._num_bytes} > capacity {self.capacity_bytes}"
                )

    def close(self) -> None:
        with self._lock:
            self._lru.clear()
            self._num_bytes = 0
