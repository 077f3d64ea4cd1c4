"""The offload coordinator: the tier stack (host -> disk -> Redis) seen as one store.

The engine hands it full blocks' payloads (:meth:`OffloadCoordinator.submit`) and asks it
which blocks of a prefix it holds (:meth:`match`, :meth:`contains_prefix`) and for their bytes
(:meth:`load`). Writes are asynchronous::

    submit(h, payload) ──▶ bounded queue ──▶ writer thread ──▶ host.put, disk.put, redis.put_many
         │ (never waits:                          (one batch at a time, upper tier first)
         │  full queue = dropped, counted)
         └▶ pending[h] = payload   served by match/load until every tier has it, so a block is
                                   never unreadable between "evicted above" and "written below"

Lookups walk the stack in order: blocks still queued, then each tier from the top; the match is
the run of consecutive blocks, from the first, that some level holds. A block loaded from a
lower tier is promoted (queued for the tiers above it).

Slower than recompute? ``load`` measures each tier's seconds per block (a moving average); once
the engine tells the coordinator what recomputing a block costs (:meth:`set_recompute_cost`),
``match`` skips a tier whose loads are slower, re-probing it every ``reprobe_every`` skips so a
tier that recovers is used again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidRequestError, InvariantViolation
from pagedkv.tiers.base import KVTier, TierStats

logger = logging.getLogger(__name__)

PENDING = "pending"
"""The name :meth:`OffloadCoordinator.match` gives blocks still in the write queue."""


@dataclass(frozen=True, slots=True)
class OffloadStats:
    """Counters of the coordinator (blocks), and a snapshot of every tier."""

    submitted: int  # submit() calls
    deduped: int  # skipped: already queued or already in every local tier
    dropped_queue_full: int  # skipped: the queue was full (the caller never waits) or closed
    written: int  # blocks the writer finished (in every tier that took them)
    write_errors: int  # unexpected exceptions from a tier's put (logged)
    promoted: int  # blocks queued for upper tiers after a load from a lower one
    loaded: int  # blocks returned by load()
    load_failures: int  # load() calls that returned fewer blocks than matched
    skipped_slow: int  # match() walks that skipped a tier slower than recompute
    load_s_per_block: tuple[tuple[str, float], ...]  # measured, per level that has loaded
    queue_len: int
    tiers: tuple[TierStats, ...]


@dataclass(slots=True)
class _Entry:
    payload: bytes
    upto: int  # write into tiers[:upto]


class OffloadCoordinator:
    """A bounded write queue and a writer thread in front of an ordered stack of tiers.

    Invariants (check_invariants() verifies each):
      O1  every queued hash is pending, and every pending hash is queued or being written
      O2  len(queue) <= max_queue_blocks
      O3  no hash is both queued and being written
    Complexity: submit O(local tiers) in memory; match O(prefix) plus one call per tier and
    level change; load one get_many per level run.
    """

    def __init__(
        self,
        tiers: Sequence[KVTier],
        *,
        max_queue_blocks: int = 1024,
        write_batch_blocks: int = 16,
        promote: bool = True,
        start: bool = True,
        reprobe_every: int = 100,
    ) -> None:
        if not tiers:
            raise InvalidRequestError("an offload coordinator needs at least one tier")
        if min(max_queue_blocks, write_batch_blocks, reprobe_every) <= 0:
            raise InvalidRequestError(
                "max_queue_blocks, write_batch_blocks and reprobe_every must be positive"
            )
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or PENDING in names:
            raise InvalidRequestError(f"tier names must be unique and not {PENDING!r}: {names}")
        self.tiers = tuple(tiers)
        self.max_queue_blocks = max_queue_blocks
        self.write_batch_blocks = write_batch_blocks
        self.promote = promote
        self._by_name = {t.name: i for i, t in enumerate(self.tiers)}
        self._local = [t for t in self.tiers if not t.is_remote]
        self._cv = threading.Condition()
        self._queue: deque[bytes] = deque()  # O2
        self._pending: dict[bytes, _Entry] = {}  # O1: queued or being written
        self._writing: set[bytes] = set()
        self._closed = False
        self._submitted = self._deduped = self._dropped = self._written = 0
        self._write_errors = self._promoted = self._loaded = self._load_failures = 0
        self.reprobe_every = reprobe_every
        self._recompute_s: float | None = None
        self._load_s: dict[str, float] = {}  # level -> moving average of load s per block
        self._skips: dict[str, int] = {}  # level -> consecutive skips since the last probe
        self._skipped_slow = 0
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the writer thread (done by the constructor unless ``start=False``)."""
        with self._cv:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._run, name="pagedkv-offload", daemon=True)
            self._thread.start()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block is written; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def close(self, flush_timeout_s: float | None = 10.0) -> None:
        """Write what is queued (up to the timeout), stop the writer, close every tier."""
        if self._thread is not None:
            self.flush(flush_timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=flush_timeout_s)
        for tier in self.tiers:
            tier.close()

    # ------------------------------------------------------------------ writes
    def submit(self, block_hash: bytes, payload: bytes) -> bool:
        """Queue a block for every tier. Never waits: returns False when the block was already
        queued or stored in every local tier (deduped) or the queue is full (dropped, counted)."""
        with self._cv:
            self._submitted += 1
        return self._enqueue(block_hash, payload, len(self.tiers))

    def _enqueue(self, block_hash: bytes, payload: bytes, upto: int) -> bool:
        with self._cv:
            if self._closed:
                self._dropped += 1
                return False
            if block_hash in self._pending:
                self._deduped += 1
                return False
        local = [t for t in self._local if self._by_name[t.name] < upto]
        if local and all(t.contains(block_hash) for t in local) and len(local) == upto:
            with self._cv:
                self._deduped += 1
            return False
        with self._cv:
            if block_hash in self._pending:
                self._deduped += 1
                return False
            if len(self._queue) >= self.max_queue_blocks:
                self._dropped += 1
                return False
            self._pending[block_hash] = _Entry(payload, upto)
            self._queue.append(block_hash)
            self._cv.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                n = min(self.write_batch_blocks, len(self._queue))
                hashes = [self._queue.popleft() for _ in range(n)]
                self._writing.update(hashes)
                batch = [(h, self._pending[h]) for h in hashes]
            for i, tier in enumerate(self.tiers):
                items = [(h, e.payload) for h, e in batch if i < e.upto]
                if not items:
                    continue
                try:
                    tier.put_many(items)
                except Exception:  # a bug in a tier must not kill the writer
                    logger.exception("offload: writing %d blocks to tier %s", len(items), tier.name)
                    with self._cv:
                        self._write_errors += 1
            with self._cv:
                for h in hashes:
                    self._writing.discard(h)
                    del self._pending[h]
                self._written += len(hashes)
                self._cv.notify_all()

    # ------------------------------------------------------------------ cost model
    def set_recompute_cost(self, s_per_block: float | None) -> None:
        """What recomputing one block's KV costs here (seconds; None: always load)."""
        if s_per_block is not None and s_per_block <= 0:
            raise InvalidRequestError(f"recompute cost must be positive, got {s_per_block}")
        with self._cv:
            self._recompute_s = s_per_block

    def _is_worth_loading(self, level: str) -> bool:
        with self._cv:
            est = self._load_s.get(level)
            if self._recompute_s is None or est is None or est < self._recompute_s:
                return True
            skips = self._skips.get(level, 0) + 1
            if skips >= self.reprobe_every:
                self._skips[level] = 0
                return True  # probe: its next load re-measures it
            self._skips[level] = skips
            self._skipped_slow += 1
            return False

    def _record_load(self, level: str, seconds: float, num_blocks: int) -> None:
        if num_blocks <= 0:
            return
        per = seconds / num_blocks
        with self._cv:
            old = self._load_s.get(level)
            self._load_s[level] = per if old is None else 0.8 * old + 0.2 * per

    # ------------------------------------------------------------------ reads
    def match(self, block_hashes: Sequence[bytes]) -> list[tuple[str, bytes]]:
        """``(level, hash)`` for the run of consecutive blocks, from the first, held somewhere
        in the stack; ``level`` is :data:`PENDING` or the name of the upper-most tier that has
        the block at that point of the walk."""
        out: list[tuple[str, bytes]] = []
        i, n = 0, len(block_hashes)
        while i < n:
            with self._cv:
                run = 0
                while i + run < n and block_hashes[i + run] in self._pending:
                    run += 1
            if run:
                out.extend((PENDING, h) for h in block_hashes[i : i + run])
                i += run
                continue
            for tier in self.tiers:
                if not self._is_worth_loading(tier.name):
                    continue
                run = tier.contains_prefix(block_hashes[i:])
                if run:
                    out.extend((tier.name, h) for h in block_hashes[i : i + run])
                    i += run
                    break
            else:
                break
        return out

    def contains_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many blocks, from the first, the stack can load (the scheduler's TierIndex)."""
        return len(self.match(block_hashes))

    def load(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Verified payloads of the matched run of ``block_hashes``, in order. Shorter than the
        match (possibly empty) when a block vanished or failed its checks meanwhile: the caller
        loads what came back and recomputes the rest."""
        plan = self.match(block_hashes)
        out: list[bytes] = []
        j = 0
        while j < len(plan):
            level = plan[j][0]
            k = j
            while k < len(plan) and plan[k][0] == level:
                k += 1
            hashes = [h for _, h in plan[j:k]]
            got = self._fetch(level, hashes)
            for h, payload in zip(hashes, got, strict=True):
                if payload is None:
                    break
                out.append(payload)
                upto = 0 if level == PENDING or not self.promote else self._by_name[level]
                if upto > 0 and self._enqueue(h, payload, upto):
                    with self._cv:
                        self._promoted += 1
            if len(out) < k:
                break
            j = k
        with self._cv:
            self._loaded += len(out)
            if len(out) < len(plan):
                self._load_failures += 1
        return out

    def fetch(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """Verified payloads of exactly these blocks, each from wherever it is (queued, or the
        upper-most tier holding it), None where none has it. Unlike :meth:`load` nothing stops
        at a gap: this serves a scheduler's ``block_loads`` list, which spans requests. Blocks
        from a lower tier are promoted like in ``load``."""
        n = len(block_hashes)
        out: list[bytes | None] = [None] * n
        with self._cv:
            for i, h in enumerate(block_hashes):
                if (e := self._pending.get(h)) is not None:
                    out[i] = e.payload
        missing = [i for i in range(n) if out[i] is None]
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            if tier.is_remote:  # a GET of an absent key costs what an EXISTS does
                ask = missing
            else:
                ask = [i for i in missing if tier.contains(block_hashes[i])]
            if not ask:
                continue
            got = self._fetch(tier.name, [block_hashes[i] for i in ask])
            for i, payload in zip(ask, got, strict=True):
                if payload is None:
                    continue
                out[i] = payload
                if level > 0 and self.promote and self._enqueue(block_hashes[i], payload, level):
                    with self._cv:
                        self._promoted += 1
            missing = [i for i in missing if out[i] is None]
        with self._cv:
            self._loaded += n - len(missing)
            if missing:
                self._load_failures += 1
        return out

    def _fetch(self, level: str, hashes: list[bytes]) -> list[bytes | None]:
        if level == PENDING:
            with self._cv:
                got = [e.payload if (e := self._pending.get(h)) else None for h in hashes]
            for i, h in enumerate(hashes):  # written (and dequeued) since the match
                for tier in self.tiers:
                    if got[i] is not None:
                        break
                    got[i] = tier.try_get(h)
            return got
        t0 = time.perf_counter()
        got = self.tiers[self._by_name[level]].get_many(hashes)
        self._record_load(level, time.perf_counter() - t0, len(hashes))
        return got

    # ------------------------------------------------------------------ reporting
    def stats(self) -> OffloadStats:
        tiers = tuple(t.stats() for t in self.tiers)
        with self._cv:
            return OffloadStats(
                submitted=self._submitted,
                deduped=self._deduped,
                dropped_queue_full=self._dropped,
                written=self._written,
                write_errors=self._write_errors,
                promoted=self._promoted,
                loaded=self._loaded,
                load_failures=self._load_failures,
                skipped_slow=self._skipped_slow,
                load_s_per_block=tuple(sorted(self._load_s.items())),
                queue_len=len(self._queue),
                tiers=tiers,
            )

    def check_invariants(self) -> None:
        with self._cv:
            queued = set(self._queue)
            if len(queued) != len(self._queue):
                raise InvariantViolation("O1: a hash is queued twice")
            if queued | self._writing != self._pending.keys():
                raise InvariantViolation(
                    f"O1: {len(queued)} queued + {len(self._writing)} writing != "
                    f"{len(self._pending)} pending"
                )
            if len(self._queue) > self.max_queue_blocks:
                raise InvariantViolation(f"O2: {len(self._queue)} queued > {self.max_queue_blocks}")
            if queued & self._writing:
                raise InvariantViolation("O3: a hash is queued and being written")
        for tier in self.tiers:
            tier.check_invariants()
