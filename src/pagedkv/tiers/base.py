"""The one interface every KV tier implements, and the counters every tier reports.

A tier maps a block hash (``bytes``, see :mod:`pagedkv.core.hashing`) to an encoded block payload
(:mod:`pagedkv.tiers.payload`). Failure contract, the same for every tier:

* a lookup that cannot be answered (missing, corrupt, evicted, server down) is a **miss**:
  ``contains_prefix`` stops there, ``try_get`` returns ``None``; the reason is counted;
* a write that cannot be done (budget too small, disk full, server down) is **dropped and
  counted**; ``put`` returns False and never raises for a transient condition;
* only a caller's mistake (a payload of the wrong layout) raises, with a typed error, and
  only explicit health checks raise :class:`~pagedkv.errors.TierUnavailableError`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pagedkv.core.events import BlockRemoved, BlockStored, EventQueue, KVEvent
from pagedkv.errors import InvalidRequestError
from pagedkv.tiers.payload import TierLayout

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier's counters (totals since start; plain values, never live).

    ``hits``/``misses`` count blocks asked of ``try_get`` (read or not); ``lookup_hits`` and
    ``lookup_misses`` count ``contains_prefix`` answers (the hit run, plus one miss when the run
    stopped before the end). ``bytes_in`` are payload bytes written to the tier, ``bytes_out``
    bytes read from it. ``dropped_writes`` are puts that did not store the block (budget, full
    disk, server down, writes disabled); ``corrupt`` are payloads that failed their checks (and
    were deleted); ``errors`` are failed I/O or network operations.
    """

    name: str
    hits: int
    misses: int
    lookup_hits: int
    lookup_misses: int
    bytes_in: int
    bytes_out: int
    evictions: int
    errors: int
    dropped_writes: int
    corrupt: int
    num_blocks: int | None  # None where the store is shared and not counted (Redis)
    num_bytes: int | None
    capacity_bytes: int | None

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class TierCounters:
    """Mutable counters behind :class:`TierStats`; callers hold the owning tier's lock."""

    __slots__ = (
        "bytes_in",
        "bytes_out",
        "corrupt",
        "dropped_writes",
        "errors",
        "evictions",
        "hits",
        "lookup_hits",
        "lookup_misses",
        "misses",
    )

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.lookup_hits = 0
        self.lookup_misses = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.evictions = 0
        self.errors = 0
        self.dropped_writes = 0
        self.corrupt = 0

    def record_lookup(self, num_asked: int, num_hit: int) -> None:
        self.lookup_hits += num_hit
        if num_hit < num_asked:
            self.lookup_misses += 1

    def snapshot(
        self, name: str, num_blocks: int | None, num_bytes: int | None, capacity_bytes: int | None
    ) -> TierStats:
        return TierStats(
            name=name,
            hits=self.hits,
            misses=self.misses,
            lookup_hits=self.lookup_hits,
            lookup_misses=self.lookup_misses,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            evictions=self.evictions,
            errors=self.errors,
            dropped_writes=self.dropped_writes,
            corrupt=self.corrupt,
            num_blocks=num_blocks,
            num_bytes=num_bytes,
            capacity_bytes=capacity_bytes,
        )


def count_prefix(index: Container[bytes], block_hashes: Sequence[bytes]) -> int:
    """Length of the run of ``block_hashes``, from the first, that ``index`` holds."""
    n = 0
    for h in block_hashes:
        if h not in index:
            break
        n += 1
    return n


class KVTier(ABC):
    """A store of block payloads keyed by block hash (host RAM, local disk, Redis/Valkey).

    Every method is thread-safe: the offload writer thread puts while the scheduler looks up.
    ``get_many``/``put_many`` default to loops; network tiers override them with pipelines.
    """

    name: str
    layout: TierLayout
    is_remote: bool = False  # a network store: asking it costs a round trip

    def __init__(self, name: str, layout: TierLayout) -> None:
        self.name = name
        self.layout = layout
        self._lock = threading.Lock()
        self._counters = TierCounters()
        self._events = EventQueue(enabled=False)  # guarded by _lock; see enable_events

    def enable_events(self, max_events: int = 10_000) -> None:
        """Queue a ``BlockStored`` / ``BlockRemoved`` (medium: this tier's name) for each block
        this tier gains or loses, for :meth:`drain_events`. Tier events name single blocks and
        carry no token ids or parent (a tier never sees tokens). A remote tier reports only
        what this process did to it (a server-side eviction is invisible here)."""
        with self._lock:
            self._events = EventQueue(max_events)

    def drain_events(self) -> list[KVEvent]:
        """Return and forget the queued events, oldest first (empty unless enabled)."""
        with self._lock:
            return self._events.drain()

    def _event_stored(self, block_hash: bytes) -> None:
        """Record that ``block_hash`` is now stored (caller holds ``_lock``)."""
        if self._events.enabled:
            self._events.push(
                BlockStored((block_hash,), None, (), self.layout.block_size, medium=self.name)
            )

    def _event_removed(self, block_hash: bytes) -> None:
        """Record that ``block_hash`` is no longer stored (caller holds ``_lock``)."""
        if self._events.enabled:
            self._events.push(BlockRemoved((block_hash,), medium=self.name))

    @abstractmethod
    def contains_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """Length of the run of consecutive hashes, from the first, that this tier holds."""

    @abstractmethod
    def try_get(self, block_hash: bytes) -> bytes | None:
        """The verified payload stored under ``block_hash``, or None (a miss, counted)."""

    @abstractmethod
    def put(self, block_hash: bytes, payload: bytes) -> bool:
        """Store ``payload`` unless present. True if stored or already present, False if the
        write was dropped (counted). Raises InvalidRequestError for a payload of another layout
        or block."""

    @abstractmethod
    def delete(self, block_hash: bytes) -> bool:
        """Remove a block; True if it was there."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the counters."""

    def check_invariants(self) -> None:  # noqa: B027  (optional for stateless tiers)
        """Recompute internal state from scratch; raise InvariantViolation on a mismatch."""

    def close(self) -> None:  # noqa: B027  (optional)
        """Release files, sockets or threads. Idempotent."""

    def contains(self, block_hash: bytes) -> bool:
        """Whether the block is stored. Local tiers answer from memory without counting a
        lookup (the offload queue asks this to dedupe); remote tiers ask the server."""
        return self.contains_prefix((block_hash,)) == 1

    def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """``try_get`` of each hash, in order."""
        return [self.try_get(h) for h in block_hashes]

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> int:
        """``put`` each ``(hash, payload)``; returns how many are stored (or were present)."""
        return sum(self.put(h, p) for h, p in items)

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalTier(KVTier, Generic[V]):
    """A tier on this machine whose index lives in memory, under a byte budget: ``_lru`` maps
    each stored block's hash to the subclass's per-block value (the payload for host RAM, the
    file size for the disk), least recently used first, and ``_num_bytes`` counts the stored
    payload bytes. Lookups answer from the index without I/O and count like any tier's; the
    subclass keeps ``_lru`` and ``_num_bytes`` in step (its invariants say how)."""

    def __init__(self, name: str, layout: TierLayout, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise InvalidRequestError(f"capacity_bytes must be positive, got {capacity_bytes}")
        super().__init__(name, layout)
        self.capacity_bytes = capacity_bytes
        self._lru: OrderedDict[bytes, V] = OrderedDict()
        self._num_bytes = 0

    @property
    def num_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._lru

    def contains_prefix(self, block_hashes: Sequence[bytes]) -> int:
        with self._lock:
            n = count_prefix(self._lru, block_hashes)
            self._counters.record_lookup(len(block_hashes), n)
            return n

    def lru_order(self) -> list[bytes]:
        """Stored hashes, least recently used first (for tests and debugging)."""
        with self._lock:
            return list(self._lru)

    def stats(self) -> TierStats:
        with self._lock:
            return self._counters.snapshot(
                self.name, len(self._lru), self._num_bytes, self.capacity_bytes
            )
